"""`relayrl router`'s entry point: hashing a key for a tenants file, refusing bad set-ups."""

from __future__ import annotations

import hashlib
import io

import pytest

from relayrl.router.cli import main


def test_hash_key_prints_the_sha256_that_a_tenants_file_stores(monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("my-secret\n"))
    assert main(["--hash-key"]) == 0
    assert capsys.readouterr().out.strip() == hashlib.sha256(b"my-secret").hexdigest()


@pytest.mark.parametrize("argv", [[], ["--backend", "not a url"],
                                  ["--backend", "http://127.0.0.1:1", "--tenants", "/nonexistent"]])
def test_bad_set_ups_exit_2_with_a_message(argv: list[str], capsys) -> None:
    try:
        code = main(argv)
    except FileNotFoundError:
        pytest.fail("a missing tenants file must be a clear message, not a traceback")
    assert code == 2 and "relayrl router:" in capsys.readouterr().err
