"""`chatstore admin migrate-v1` against a live server: a conversation whose records were sealed
by version 1 reads as absent until the server, given the old secret, migrates them; then it
reads back and continues (its KV, under keys no longer held, recomputes)."""

from __future__ import annotations

import base64
import os
import shutil

import httpx
import pytest

from chatstore.private_file import write_private
from chatstore.store.sealing import Keyring, Sealer
from chatstore.store.sealing.key_store_lmdb import LmdbKeyStore
from chatstore.store.sealing.master_key import Secret, new_secret_line, parse_secrets
from tests.support.tenant_server import ADMIN, GREEDY
from tests.support.tenant_server import converse as _converse
from tests.support.tenant_server import tenant_server as _server
from tests.support.v1_seal import to_v1_lmdb

pytestmark = pytest.mark.timeout(300)


@pytest.mark.model
def test_migrate_v1_command_brings_back_version_1_records(
    default_model, tmp_path, capsys, monkeypatch
):
    from chatstore.cli import main

    data = tmp_path / "data"
    writer_master = new_secret_line("w1")
    with _server(data, default_model, secret_key=writer_master, persist="write_through") as srv:
        sid = _converse(srv.url, "ZQX-v1-record")
    # The records as version 1 sealed them under the old secret; the writer's data keys gone
    # (so its KV chunks are under keys no one holds, as version 1's were: they recompute).
    old = Secret("k1", os.urandom(32))
    keys = LmdbKeyStore(data / "keys.lmdb")
    writer = Sealer(Keyring(parse_secrets(writer_master, "test"), keys))
    assert to_v1_lmdb(data / "records.lmdb", writer, old) >= 2
    keys.close()
    shutil.rmtree(data / "keys.lmdb")
    legacy = tmp_path / "legacy-v1.key"  # the old <data_dir>/secret.key, moved out
    write_private(legacy, f"k1:{base64.b64encode(old.material).decode()}\n")
    monkeypatch.delenv("CHATSTORE_LEGACY_SECRET_KEY", raising=False)
    monkeypatch.delenv("CHATSTORE_LEGACY_SECRET_FILE", raising=False)

    admin = ["admin", "--admin-key", ADMIN]
    alice = {"Authorization": "Bearer key-alice"}
    server = _server(data, default_model, secret_key=new_secret_line("m1"))
    with (
        server as srv,
        httpx.Client(base_url=srv.url, headers=alice, timeout=120, trust_env=False) as c,
    ):
        assert c.get(f"/v1/sessions/{sid}").status_code == 404  # absent before
        # The server was given no legacy secret: refused, saying how to give it.
        assert main([*admin, "--url", srv.url, "migrate-v1"]) == 1
        assert "CHATSTORE_LEGACY_SECRET_FILE" in capsys.readouterr().err
        monkeypatch.setenv("CHATSTORE_LEGACY_SECRET_FILE", str(legacy))  # read at job start
        assert main([*admin, "--url", srv.url, "migrate-v1"]) == 0
        assert "done: migrate-v1" in capsys.readouterr().out
        session = c.get(f"/v1/sessions/{sid}")
        assert session.status_code == 200
        assert "ZQX-v1-record" in session.text
        reply = c.post(f"/v1/sessions/{sid}/messages", json={"content": "Again.", **GREEDY})
        assert reply.status_code == 200, reply.text
