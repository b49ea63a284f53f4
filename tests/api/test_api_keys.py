"""API keys not in the clear (issue 26, item 4): the keys file holds salted scrypt hashes and is
managed by `chatstore keys add|list|revoke`; a tenant may hold several keys, one revoked while
the other keeps working (no restart); plain keys from the environment are hashed at start;
every refusal is counted in /metrics by reason. One real server on the default model."""

from __future__ import annotations

import json
import os
import re
import stat

import httpx
import pytest

from chatstore.api.common.api_keys import HashedKeys
from chatstore.api.common.key_file import KeyFile, KeyFileError, parse_key
from chatstore.api.common.settings import ServerSettings, forget_plain_keys
from chatstore.cli import main
from chatstore.config import load_config
from chatstore.server.launcher import local_server
from tests.api.test_limits import error_of

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

PLAIN = "plain-carol-key"  # a key from CHATSTORE_API_KEYS
SMALL = {"kv_cache_bytes": 32 << 20, "dram_bytes": 64 << 20}


def keys_cli(capsys, data_dir, *args: str) -> tuple[int, str, str]:
    """`chatstore keys --data-dir data_dir …` in this process: exit code, stdout, stderr."""
    code = main(["keys", "--data-dir", str(data_dir), *args])
    out, err = capsys.readouterr()
    return code, out, err


def add_key(capsys, data_dir, *args: str) -> str:
    code, out, _ = keys_cli(capsys, data_dir, "add", *args)
    assert code == 0
    return out.strip()


def key_id(key: str) -> str:
    parsed = parse_key(key)
    assert parsed is not None, key
    return parsed[0]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def failures(client: httpx.Client) -> dict[str, float]:
    text = client.get("/metrics").text
    found = re.findall(r'^chatstore_auth_failures_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    return {reason: float(value) for reason, value in found}


def test_the_cli_keeps_hashes_only_and_lists_without_keys(tmp_path, capsys):
    first = add_key(capsys, tmp_path, "--tenant", "alice")
    second = add_key(capsys, tmp_path, "--tenant", "alice")
    admin = add_key(capsys, tmp_path, "--admin")
    path = tmp_path / "api_keys.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = path.read_text()
    for key in (first, second, admin):
        assert parse_key(key)[1] not in raw  # the secret part is nowhere in the file
    records = KeyFile(path).load()
    assert [(r.tenant, r.admin) for r in records] == [
        ("alice", False), ("alice", False), ("admin", True)
    ]  # fmt: skip
    assert records[0].matches(parse_key(first)[1]) and not records[0].matches(parse_key(second)[1])

    code, out, _ = keys_cli(capsys, tmp_path, "list")
    assert code == 0 and key_id(first) in out and "alice" in out
    assert all(parse_key(k)[1] not in out for k in (first, second, admin))
    code, out, _ = keys_cli(capsys, tmp_path, "list", "--json")
    listed = json.loads(out)["keys"]
    assert [k["id"] for k in listed] == [key_id(first), key_id(second), key_id(admin)]
    assert all(set(k) == {"id", "tenant", "admin", "created", "revoked"} for k in listed)

    code, out, _ = keys_cli(capsys, tmp_path, "revoke", key_id(first))
    assert code == 0 and "revoked" in out
    assert [r.active for r in KeyFile(path).load()] == [False, True, True]
    code, _, err = keys_cli(capsys, tmp_path, "revoke", "0123456789ab")
    assert code == 1 and "no key with id" in err
    code, _, err = keys_cli(capsys, tmp_path, "add")
    assert code == 1 and "--tenant" in err


def test_an_unsafe_or_malformed_keys_file_is_refused(tmp_path, capsys):
    add_key(capsys, tmp_path, "--tenant", "alice")
    path = tmp_path / "api_keys.json"
    path.chmod(0o620)  # group-writable: anyone in the group could add a key
    with pytest.raises(KeyFileError, match="writable by group or others"):
        ServerSettings(api_keys_file=str(path))
    path.chmod(0o600)
    path.write_text('{"version": 1, "keys": [{"id": "x"}]}')
    with pytest.raises(KeyFileError, match="malformed"):
        KeyFile(path).load()


def test_plain_keys_are_hashed_at_start_and_forgotten(tmp_path):
    env = {"CHATSTORE_API_KEYS": f"{PLAIN}:carol", "CHATSTORE_ADMIN_KEY": "plain-admin-key"}
    config = load_config(env=env)
    settings = ServerSettings.from_config(config, env={**env, "CHATSTORE_DATA_DIR": str(tmp_path)})
    assert isinstance(settings.api_keys, HashedKeys) and settings.admin_key is None
    assert len(settings.api_keys.tenants) == 1 and len(settings.api_keys.admins) == 1
    held = repr(vars(settings)) + repr(settings.api_keys.tenants) + repr(settings.api_keys.admins)
    assert PLAIN not in held and "plain-admin-key" not in held
    assert not settings.local_mode
    scrubbed = forget_plain_keys(config, env)
    assert (scrubbed.api_keys, scrubbed.admin_key) == ("", "")
    assert "CHATSTORE_API_KEYS" not in env and "CHATSTORE_ADMIN_KEY" not in env


@pytest.fixture(scope="module")
def keyed(default_model, tmp_path_factory):
    """A server with a keys file (in its data directory, created before it starts) and one
    plain key, as CHATSTORE_API_KEYS would give it."""
    data = tmp_path_factory.mktemp("api-keys")
    KeyFile(data / "api_keys.json").add("nobody")  # the file exists: keyed mode
    settings = ServerSettings(api_keys={PLAIN: "carol"}, api_keys_file=str(data / "api_keys.json"))
    with local_server(data, default_model, settings, **SMALL) as srv:
        yield srv, data


def test_rotation_without_downtime_and_failed_auth_counts(keyed, capsys):
    server, data = keyed
    old = add_key(capsys, data, "--tenant", "alice")  # added while the server runs
    new = add_key(capsys, data, "--tenant", "alice")
    bob = add_key(capsys, data, "--tenant", "bob")
    admin = add_key(capsys, data, "--admin")
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = failures(http)
        assert set(before) == {"missing", "malformed", "invalid", "revoked", "forbidden"}

        created = http.post("/v1/sessions", json={}, headers=auth(old))
        assert created.status_code == 201, created.text
        sid = created.json()["id"]
        for key in (old, new):  # both of alice's keys are alice
            assert http.get(f"/v1/sessions/{sid}", headers=auth(key)).status_code == 200
        assert http.get(f"/v1/sessions/{sid}", headers=auth(bob)).status_code == 404
        assert http.get("/v1/sessions", headers=auth(PLAIN)).status_code == 200  # hashed env key
        assert http.get("/admin/cache", headers=auth(admin)).status_code == 200

        code, _, _ = keys_cli(capsys, data, "revoke", key_id(old))
        assert code == 0
        assert error_of(http.get("/v1/sessions", headers=auth(old)), 401)["code"] == (
            "invalid_api_key"
        )
        assert http.get(f"/v1/sessions/{sid}", headers=auth(new)).status_code == 200

        wrong_secret = old[:-4] + ("AAAA" if not old.endswith("AAAA") else "BBBB")
        error_of(http.get("/v1/sessions", headers=auth(wrong_secret)), 401)
        error_of(http.get("/v1/sessions", headers=auth("not-a-key")), 401)
        error_of(http.get("/v1/sessions"), 401)
        error_of(http.get("/v1/sessions", headers={"Authorization": f"Basic {new}"}), 401)
        error_of(http.get("/admin/cache", headers=auth(new)), 403)
        error_of(http.get("/v1/sessions", headers=auth(admin)), 403)

        after = failures(http)
    counted = {reason: after[reason] - before[reason] for reason in after}
    assert counted == {"revoked": 1, "invalid": 2, "missing": 1, "malformed": 1, "forbidden": 2}


def test_a_keys_file_made_unsafe_while_serving_keeps_the_keys_read_before(keyed, capsys):
    server, data = keyed
    key = add_key(capsys, data, "--tenant", "dave")
    path = data / "api_keys.json"
    with httpx.Client(base_url=server.url, timeout=120) as http:
        assert http.get("/v1/sessions", headers=auth(key)).status_code == 200
        os.chmod(path, 0o666)
        try:
            os.utime(path)  # a new stamp: the server re-reads, refuses, keeps what it had
            assert http.get("/v1/sessions", headers=auth(key)).status_code == 200
        finally:
            os.chmod(path, 0o600)
