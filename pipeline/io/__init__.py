"""Storage for every stage: fsspec paths, atomic output, the tar format, devices.

fs.py       local paths or fsspec URLs, bounded reads, hashes
output.py   Output: write locally, publish atomically (local folder or any fsspec URL)
tar.py      the one tar writer and streaming reader for WebDataset shards, one key rule (split_key)
devices.py  the kind of device behind a path (nvme, ssd, rotational, network) and its free space
cache.py    ShardCache: remote shards filled into a local, bounded cache as they stream, verified, shared by a machine
"""
