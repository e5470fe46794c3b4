"""Storage for every stage: fsspec paths, atomic output, the tar format, devices.

fs.py            local paths or fsspec URLs, bounded reads, hashes
output.py        Output: write locally, publish atomically (local folder or any fsspec URL)
tar.py           the one tar streaming reader for WebDataset shards, and where reader and writer are imported from
tar_format.py    the tar format both share: the one key rule (split_key), the block size, the header parser
tar_write.py     the one tar writer: members built by hand, a hidden temp file, fsync and rename
devices.py       the kind of device behind a path (nvme, ssd, rotational, network) and its free space
cache.py         ShardCache: remote shards filled into a local, bounded cache as they stream, verified, shared by a machine;
                 it ties the cache_* parts together
cache_files.py   the shard cache's folder: where each file of a shard lives, the flocks that guard them, file helpers
cache_fill.py    a shard filled into the cache under its lock, checked and published; prefetches; the download from the store
cache_follow.py  a reader of a fill in progress (this process's or another's), going on from the store where it stops
cache_verify.py  a cached shard checked before it is served: its fill's record, a whole sha256 where it differs
cache_space.py   the cache's space counted across processes, room for a fill reserved or refused, nothing evicted; prune
transport.py     Transport: the operations every stage asks of a store; FsspecTransport, the general fsspec one
transports.py    transport_for(fs): the transport for a filesystem, one per filesystem and process
s3config.py      S3Settings: an s3fs filesystem's endpoint, addressing, regions learnt, refused buckets, credentials
s3transport.py   S3Transport: reads and listings of plain S3 endpoints on gpufeed's own client, s3fs for the rest
getloop.py       GetLoop: the S3 client's event loop: reads ahead, many GETs in flight on one thread, retries, DNS off the loop
s3blocking.py    BlockingClient: the S3 client's blocking reads, one GET at a time on the calling thread, connections kept
s3request.py     GetRequest: one GET, its bytes (the one request builder), and what its answer means (retry, region, 403)
http1.py         Connection: the HTTP/1.1 exchange on one connection: the one parser, lengths and size caps checked
s3sign.py        AWS Signature Version 4 for the client's requests
"""
