"""The actors, one folder each (tokenizer/, scheduler/, cache_manager/, executor/, transfer/),
and what they share at this level: the mailbox (mailbox.py), the messages (messages.py,
transfer_messages.py), what replies carry (replies.py), supervision (supervise.py) and the
wiring that starts them (wiring.py, disagg_wiring.py). An actor's folder imports this level
and no other actor's folder: actors talk only through messages."""
