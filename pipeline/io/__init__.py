"""Storage for every stage: fsspec paths, atomic output, the tar format, devices.

fs.py       local paths or fsspec URLs, bounded reads, hashes
output.py   Output: write locally, publish atomically (local folder or any fsspec URL)
transport.py  Transport: the operations every stage asks of a store; FsspecTransport, the general fsspec one
transports.py transport_for(fs): the transport for a filesystem, one per filesystem and process
s3config.py S3Settings: an s3fs filesystem's endpoint, addressing, regions learnt, refused buckets, credentials
s3transport.py  S3Transport: reads and listings of plain S3 endpoints on gpufeed's own client, s3fs for the rest
getloop.py  GetLoop: gpufeed's S3 client: one request builder, one parser, many GETs in flight on one thread
s3sign.py   AWS Signature Version 4 for the client's requests
tar.py      the one tar writer and streaming reader for WebDataset shards, one key rule (split_key)
devices.py  the kind of device behind a path (nvme, ssd, rotational, network) and its free space
cache.py    ShardCache: remote shards filled into a local, bounded cache as they stream, verified, shared by a machine
"""
