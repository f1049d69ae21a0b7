"""Prefill/decode disaggregation's transport: the KV layout two servers agree on, the
bootstrap handshake's wire types, server and client, and the transfer backends (Mooncake's
engine, or an in-process copy). No actors here: `actors/transfer/kv_transfer.py` owns each room's
state machine and uses these (docs/disaggregation.md)."""
