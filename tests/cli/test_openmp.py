"""The CLI shortens libgomp's idle spin before llama_cpp (and with it libgomp) is loaded."""

from __future__ import annotations

import subprocess
import sys

from server.cli import OPENMP_SPINCOUNT, tame_openmp_spin


def test_spin_count_defaults_when_unset() -> None:
    env: dict[str, str] = {}
    tame_openmp_spin(env)
    assert env == {"GOMP_SPINCOUNT": OPENMP_SPINCOUNT}


def test_a_users_openmp_setting_wins() -> None:
    for user in ({"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "active"}):
        env = dict(user)
        tame_openmp_spin(env)
        assert env == user


def test_importing_the_cli_does_not_load_llama_cpp() -> None:
    # libgomp reads GOMP_SPINCOUNT once, when llama_cpp's libraries load: main() sets it first,
    # which only works while importing server.cli leaves llama_cpp unloaded
    code = "import sys, server.cli; print('llama_cpp' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
