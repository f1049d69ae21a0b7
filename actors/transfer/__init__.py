"""The KV transfer actor of a disaggregated server (docs/disaggregation.md): `KVTransfer`
(kv_transfer.py) over one side's rooms, `SendRooms` (kv_send.py, prefill) or `ReceiveRooms`
(kv_receive.py, decode)."""
