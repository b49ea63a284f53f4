"""`chatstore admin …`: operator commands run against a live server's /admin API.

    chatstore admin rotate-keys       master-key rotation: every tenant's data key wrapped by
                                      the newest master key (seconds; no data is re-sealed)
    chatstore admin rotate-data-keys  new data keys for every tenant, every value re-sealed
                                      under them, the old keys dropped (in the background;
                                      this starts or resumes it and prints its progress)
    chatstore admin encrypt-existing  seal the values written with encrypt_at_rest = false
                                      (the only way a clear value becomes sealed; as above)
    chatstore admin migrate-v1        re-seal the records sealed by version 1 (before envelope
                                      keys) under the tenants' data keys (as above); the server
                                      must have been started with the old secret in
                                      CHATSTORE_LEGACY_SECRET_FILE (or _KEY)
    chatstore admin shred-tenant T    crypto-shred tenant T (its data keys, then its data)

They talk to the server rather than open the data directory: the server holds the LMDB
environments and its in-memory index, and with replicas the values live in Redis. No key
material crosses the API: migrate-v1's old secret is given to the server process, as its
master key is.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any
from urllib.parse import quote

import httpx

POLL_S = 1.0
# command -> (help, the endpoint that starts it)
JOBS = {
    "rotate-data-keys": "new data keys for every tenant; re-seal all stored data under them",
    "encrypt-existing": "seal the values written with encrypt_at_rest = false",
    "migrate-v1": "re-seal the records sealed by version 1 (the server holds the old secret)",
}
ENDPOINTS = {
    "rotate-data-keys": "/admin/keys/rotate-data",
    "encrypt-existing": "/admin/keys/encrypt-existing",
    "migrate-v1": "/admin/keys/migrate-v1",
}


def add_admin_parser(sub: argparse._SubParsersAction) -> None:
    admin = sub.add_parser("admin", help="operator commands against a running server")
    admin.add_argument(
        "--url",
        default=os.environ.get("CHATSTORE_URL", "http://127.0.0.1:8000"),
        help="the server (default $CHATSTORE_URL or http://127.0.0.1:8000)",
    )
    admin.add_argument(
        "--admin-key",
        dest="admin_key",
        default=os.environ.get("CHATSTORE_ADMIN_KEY", ""),
        help="sent as Authorization: Bearer (default $CHATSTORE_ADMIN_KEY; none in local mode)",
    )
    what = admin.add_subparsers(dest="admin_command", required=True)
    what.add_parser("rotate-keys", help="wrap every data key by the newest master key")
    for job, text in JOBS.items():
        parser = what.add_parser(job, help=text)
        parser.add_argument("--no-wait", action="store_true", help="start it and return")
    shred = what.add_parser("shred-tenant", help="destroy a tenant's key, then its data")
    shred.add_argument("tenant")


def cmd_admin(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except httpx.HTTPError as exc:  # the server is not there: said as an error, not a trace
        raise ValueError(f"cannot reach {args.url}: {exc}") from None


def _run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.admin_key}"} if args.admin_key else {}
    # trust_env off: a proxy set in the environment must not see the admin key.
    with httpx.Client(base_url=args.url, headers=headers, timeout=30.0, trust_env=False) as http:
        if args.admin_command == "shred-tenant":
            reply = _checked(http.delete(f"/admin/tenants/{quote(args.tenant, safe='')}/data"))
            print(
                f"tenant {reply['tenant']!r}: key destroyed; {reply['sessions']} sessions and "
                f"{reply['responses']} stored responses purged"
            )
            return 0
        if args.admin_command == "rotate-keys":
            reply = _checked(http.post("/admin/keys/rotate", json={}))
            print(f"rewrapped the data keys of {reply['rewrapped_tenants']} tenants")
            return 0
        progress = _checked(http.post(ENDPOINTS[args.admin_command], json={}))
        while True:
            print(_progress_line(progress), flush=True)
            if progress["done"] or args.no_wait:
                return 0
            if not progress["running"]:
                print(f"chatstore: {progress['job']} stopped: {progress['error']}", file=sys.stderr)
                print("run the same command again to resume from its cursor", file=sys.stderr)
                return 1
            time.sleep(POLL_S)
            progress = _checked(http.get("/admin/keys/rotation"))


def _progress_line(p: dict[str, Any]) -> str:
    unopened = f", {p['unopened']} did not open (left as they were)" if p["unopened"] else ""
    if p["done"]:
        return f"done: {p['job']}: {p['resealed']} values sealed{unopened}"
    chunks = f"{p['scanned_chunks']}/{p['total_chunks']} chunks" if p["total_chunks"] else ""
    return f"{p['job']}: {p['phase']}: {p['resealed']} values sealed {chunks}".rstrip() + unopened


def _checked(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise ValueError(f"{response.request.url.path}: HTTP {response.status_code}: {message}")
    return response.json()
