"""Model families: one file each over shared parts (kv_pool.py, ../linear.py, ../attention.py),
registered in registry.py."""
