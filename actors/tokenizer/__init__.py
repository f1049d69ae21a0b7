"""The tokenizer actor, the front desk (docs/architecture.md, "Tokenizer: the front desk"):
`Tokenizer` (tokenizer.py) over its parts, each owning its state: `Intake` (intake.py, over
encode.py), `RequestStreams` (output.py, over detokenize.py and stops.py), `UpdateLock`
(update_lock.py), `WeightWriter` (weight_writer.py) and `SessionBook` (sessions.py)."""
