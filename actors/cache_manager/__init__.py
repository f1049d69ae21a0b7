"""The cache manager actor (docs/architecture.md, "Cache manager"): `CacheManager`
(cache_manager.py) answers one `PlanRequest` per step over `cache.KVCache`."""
