"""Where chunks live: DRAM (block pool), LMDB (SSD), Redis (remote), and the hierarchy over them."""
