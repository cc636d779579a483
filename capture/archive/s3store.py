"""`s3://` archive (boto3): multipart above 8 MiB, success only once S3 confirmed the object."""

from __future__ import annotations

from pathlib import Path

from .base import ArchiveError
from .paths import archive_path, join_uri, resolve

_RETRYABLE = {"RequestTimeout", "SlowDown", "InternalError", "ServiceUnavailable", "503", "500"}


class S3Store:
    def __init__(self, prefix: str, *, endpoint_url: str | None = None, client=None,
                 multipart_threshold: int = 8 << 20, connect_timeout: float = 5, read_timeout: float = 30):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        u = archive_path(prefix)
        if u.scheme != "s3":
            raise ArchiveError(f"not an s3://bucket/prefix URI: {prefix!r}")
        self.prefix = prefix.rstrip("/")
        self.bucket, self.base = u.netloc, u.path.strip("/")
        self._client = client or boto3.client(
            "s3", endpoint_url=endpoint_url,
            config=Config(connect_timeout=connect_timeout, read_timeout=read_timeout,
                          retries={"max_attempts": 2, "mode": "standard"}))
        self._transfer = TransferConfig(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_threshold)

    def _key(self, uri: str) -> str:
        return resolve(self.prefix, uri).path.lstrip("/")  # the decoded key that was checked

    def _fail(self, what: str, exc: Exception) -> ArchiveError:
        from botocore.exceptions import ClientError
        # boto3's transfer manager wraps S3's answer (S3UploadFailedError); judge by the answer itself
        answer: BaseException | None = exc
        while answer is not None and not isinstance(answer, ClientError):
            answer = answer.__cause__ or answer.__context__
        code = answer.response.get("Error", {}).get("Code", "") if isinstance(answer, ClientError) else ""
        retryable = answer is None or code in _RETRYABLE
        return ArchiveError(f"{what}: {exc}", retryable=retryable)

    def put_file(self, local: Path, key: str) -> str:
        uri = join_uri(self.prefix, key)
        try:
            self._client.upload_file(str(local), self.bucket, self._key(uri), Config=self._transfer)
            self._client.head_object(Bucket=self.bucket, Key=self._key(uri))
        except Exception as exc:  # botocore raises many unrelated types for network faults
            raise self._fail(f"uploading {local} to {uri}", exc) from exc
        return uri

    def put_bytes(self, data: bytes, key: str, content_type: str = "application/json") -> str:
        uri = join_uri(self.prefix, key)
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(uri), Body=data, ContentType=content_type)
        except Exception as exc:
            raise self._fail(f"writing {uri}", exc) from exc
        return uri

    def get_bytes(self, uri: str) -> bytes:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(uri))["Body"].read()
        except Exception as exc:
            raise self._fail(f"reading {uri}", exc) from exc

    def download(self, uri: str, dest: Path) -> Path:
        try:
            self._client.download_file(self.bucket, self._key(uri), str(dest), Config=self._transfer)
        except Exception as exc:
            raise self._fail(f"reading {uri}", exc) from exc
        return dest

    def exists(self, uri: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(uri))
            return True
        except Exception:
            return False
