"""`chatstore keys …`: the API keys file (hashed keys, several per tenant).

    chatstore keys add --tenant alice [--admin]   a new key, printed once on stdout
    chatstore keys list [--json]                  id, tenant, role, created, revoked; no key
    chatstore keys revoke <id>                    refused from the server's next check on

The file is `api_keys_file`, else <data_dir>/api_keys.json (the same --config / --data-dir /
CHATSTORE_* the server reads). A running server re-reads it when it changes, so a key is rotated
without downtime: add the new one, move the client over, revoke the old one. A server started
with no key at all (local mode) ignores a keys file created later: restart it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from chatstore.api.common.api_keys import default_keys_file
from chatstore.api.common.key_file import KeyFile, KeyRecord
from chatstore.config import load_config


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="add, list or revoke API keys (stored hashed)")
    keys.add_argument("--config", help="TOML config file (for data_dir / api_keys_file)")
    keys.add_argument("--data-dir", dest="data_dir", help="the server's data directory")
    keys.add_argument("--keys-file", dest="api_keys_file", help="the keys file itself")
    what = keys.add_subparsers(dest="keys_command", required=True)
    add = what.add_parser("add", help="make a key for a tenant; prints it once")
    add.add_argument("--tenant", help="the tenant the key acts as (required but with --admin)")
    add.add_argument("--admin", action="store_true", help="an admin key (/admin, not a tenant)")
    listing = what.add_parser("list", help="the keys: id, tenant, created, revoked")
    listing.add_argument("--json", action="store_true", help="one JSON object, no hashes")
    revoke = what.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")


def keys_file_of(args: argparse.Namespace) -> KeyFile:
    overrides = {"data_dir": args.data_dir, "api_keys_file": args.api_keys_file}
    return KeyFile(default_keys_file(load_config(args.config, overrides)))


def cmd_keys(args: argparse.Namespace) -> int:
    keys = keys_file_of(args)
    if args.keys_command == "add":
        if not args.tenant and not args.admin:
            raise ValueError("keys add needs --tenant (or --admin for an admin key)")
        made = keys.add(args.tenant or "admin", admin=args.admin)
        role = "admin key" if args.admin else f"key for tenant {args.tenant!r}"
        print(
            f"chatstore: added {role}, id {made.record.id}, to {keys.path}. The key is "
            "shown this once; only its hash is kept:",
            file=sys.stderr,
        )
        print(made.key)
        return 0
    if args.keys_command == "revoke":
        try:
            record = keys.revoke(args.key_id)
        except KeyError:
            raise ValueError(f"no key with id {args.key_id} in {keys.path}") from None
        print(f"revoked key {record.id} (tenant {record.tenant!r}) at {_when(record.revoked)}")
        return 0
    records = keys.load()
    if args.json:
        shown = [{k: v for k, v in asdict(r).items() if k in _LISTED} for r in records]
        print(json.dumps({"file": str(keys.path), "keys": shown}))
        return 0
    print(_table(records) if records else f"no keys in {keys.path}")
    return 0


_LISTED = ("id", "tenant", "admin", "created", "revoked")  # never the salt or hash


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _table(records: list[KeyRecord]) -> str:
    rows = [("ID", "TENANT", "ROLE", "CREATED", "REVOKED")]
    for r in records:
        role = "admin" if r.admin else "tenant"
        rows.append((r.id, r.tenant, role, _when(r.created), _when(r.revoked)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )
