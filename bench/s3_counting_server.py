"""moto's S3 server with every request counted by kind, as the object store saw it (for bench/bench_fleet_scale.py).

    python bench/s3_counting_server.py PORT

The counts are what the store served, independent of the client-side counts (app/base/storage_counts.py):
`GET /_regen_counts` returns them as JSON (`PUT`, `GET`, `HEAD`, `LIST`, `DELETE`, `POST`, `COPY`, and the
request and response body bytes), and is not itself counted. A request is a LIST when it reads a bucket (no key)
with GET; a PUT with `x-amz-copy-source` is a COPY.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter

COUNTS_PATH = "/_regen_counts"


class CountingApp:
    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()
        self.counts: Counter = Counter()

    def kind(self, environ) -> str:
        method = environ.get("REQUEST_METHOD", "GET")
        key = environ.get("PATH_INFO", "/").strip("/").partition("/")[2]
        if method == "GET" and not key:
            return "LIST"
        if method == "PUT" and environ.get("HTTP_X_AMZ_COPY_SOURCE"):
            return "COPY"
        return method

    def __call__(self, environ, start_response):
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with self.lock:
                body = json.dumps(dict(self.counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        kind = self.kind(environ)
        size = int(environ.get("CONTENT_LENGTH") or 0)
        with self.lock:
            self.counts[kind] += 1
            self.counts["bytes_in"] += size
        return self._counted(self.app(environ, start_response))

    def _counted(self, out):
        sent = 0
        for chunk in out:
            sent += len(chunk)
            yield chunk
        if hasattr(out, "close"):
            out.close()
        with self.lock:
            self.counts["bytes_out"] += sent


def main() -> None:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    port = int(sys.argv[1])
    app = CountingApp(DomainDispatcherApplication(create_backend_app))
    make_server("127.0.0.1", port, app, threaded=True).serve_forever()


if __name__ == "__main__":
    main()
