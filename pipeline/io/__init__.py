"""Storage for every stage: fsspec paths, atomic output, the tar format, devices.

fs.py            local paths or fsspec URLs, bounded reads, hashes
output.py        Output: write locally, publish atomically (local folder or any fsspec URL)
tar.py           the one tar streaming reader for WebDataset shards, and where reader and writer are imported from
tar_format.py    the tar format both share: the one key rule (split_key), the block size, the header parser
tar_write.py     the one tar writer: members built by hand, a hidden temp file, fsync and rename
devices.py       the kind of device behind a path (nvme, ssd, rotational, network) and its free space
transport.py     Transport: the operations every stage asks of a store; FsspecTransport, the general fsspec one
transports.py    transport_for(fs): the transport for a filesystem, one per filesystem and process
cache/           ShardCache: remote shards filled into a local, bounded cache as they stream, verified, shared by a machine
s3/              S3Transport: gpufeed's own S3 client (signing, requests, HTTP/1.1, its event loop, blocking reads)
"""
