"""Durable session records, their prefix index, stored Responses and the turns' leases.

record.py        SessionRecord, ChainRecord, SessionLease and the errors (values)
base.py          RecordStore (the contract every backend keeps)
record_sealing.py  RecordSealing: a store's records sealed under their tenant's key, values
                 that fail to open counted, re-sealing (rotation, encrypt-existing, migrate-v1)
lmdb.py          LmdbRecordStore: one LMDB environment, synchronous commits (the default)
lmdb_log.py      its records: a small header and an append-only log of turns (O(new) a turn),
                 written and opened in the store's transaction
lmdb_facts.py    its per-tenant session counts and expiry index (same txn as the record)
lmdb_index.py    LmdbPrefixIndex: its prefix index entries (same txn as the record)
lmdb_migrations.py  its one-time migrations at start, and re-sealing in place
lmdb_responses.py, redis_responses.py   each backend's Responses namespace
redis.py         RedisRecordStore: records shared by replicas through one Redis
redis_facts.py   its breaker-guarded calls; counts and expiry (a sorted set per tenant), the
                 sessions a start reads (a set per tenant)
redis_log.py     its records: LMDB's header and log layout in a Redis string and list
redis_index.py   RedisPrefixIndex: its prefix index (a hash per tenant, best effort)
redis_start.py   its start: legacy names tagged and older records counted once per Redis
prefix_index.py  which session a client that resends its history continues (O(1) a step)
responses.py     stored Responses: their own record type and namespace
leases.py        a turn's lease on its session, so replicas run one turn at a time
"""
