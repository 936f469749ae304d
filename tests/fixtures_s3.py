"""A real S3 server for tests (moto's server mode on 127.0.0.1), with the standard AWS variables pointing at it and
one empty bucket, `BUCKET`, also set as `BACKUP_BUCKET`."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

BUCKET = "art-backups"


@pytest.fixture
def s3_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from moto.server import ThreadedMotoServer

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "BACKUP_BUCKET": BUCKET,
    }.items():
        monkeypatch.setenv(key, value)
    import boto3
    import httpx

    httpx.post(f"http://127.0.0.1:{port}/moto-api/reset").raise_for_status()  # moto's state is per process
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
    s3.create_bucket(Bucket=BUCKET)
    try:
        yield s3
    finally:
        server.stop()
