"""gpufeed's own S3 client: signed GETs and listings of plain S3 endpoints, many in flight on one thread.

    transport.py  S3Transport: reads and listings of plain S3 endpoints on this client, s3fs for the rest
    config.py     S3Settings: an s3fs filesystem's endpoint, addressing, regions learnt, refused buckets, credentials
    getloop.py    GetLoop: the client's event loop: reads ahead, many GETs in flight on one thread, retries, DNS off the loop
    blocking.py   BlockingClient: the client's blocking reads, one GET at a time on the calling thread, connections kept
    request.py    GetRequest: one GET, its bytes (the one request builder), and what its answer means (retry, region, 403)
    http1.py      Connection: the HTTP/1.1 exchange on one connection: the one parser, lengths and size caps checked
    sign.py       AWS Signature Version 4 for the client's requests
"""
