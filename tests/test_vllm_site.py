"""The vLLM commands find vLLM themselves (``replica/vllm_site.py``): scripts/setup.sh installs it apart,
in ``.vllm_site``, and ``check-layout``/``demo --engine-kind vllm`` put that folder on their own path
(and their children's) with one line on stderr, with no PYTHONPATH set by hand.

Every test runs the command in a child process with no .vllm_site on its PYTHONPATH (this process
keeps it off its path too: tests/conftest.py) and this process's p2pweights (CI's installed wheel).
The child is what CI's fresh virtual environment runs, so a package vLLM imports that setup.sh
forgets (cloudpickle) fails here, and the module-origin test fails even on a machine whose base
Python happens to hold it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, VLLM_SITE, in_ci
from replica_configs import write_config

if not (VLLM_SITE / "vllm" / "__init__.py").is_file():
    if in_ci():
        pytest.fail(f"CI=true but {VLLM_SITE} holds no vLLM: scripts/setup.sh installs vLLM 0.33 there",
                    pytrace=False)
    pytest.skip(f"no vLLM in {VLLM_SITE}: run scripts/setup.sh (it installs vLLM 0.33 there)",
                allow_module_level=True)

USING = "p2pweights: vLLM is not importable in this Python; using vLLM "
CHECK = ["check-layout", "--engine-kind", "vllm", "--engine", "tp=1"]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment without P2PW_VLLM_SITE and without any .vllm_site on PYTHONPATH:
    the child imports this process's p2pweights (CI's installed wheel; the source where PYTHONPATH
    names it), and vLLM only as the command finds it."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "P2PW_VLLM_SITE")}
    kept = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and ".vllm_site" not in p]
    return {**env, **({"PYTHONPATH": os.pathsep.join(kept)} if kept else {}), **extra}


def run(args: list[str], cwd, timeout: float = 240, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=child_env(**extra), capture_output=True, text=True,
                          timeout=timeout)


def errors(stderr: str) -> list[str]:
    """stderr's lines but the 'using vLLM' one."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(USING)]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return write_config("qwen3", str(tmp_path_factory.mktemp("vllm_site_configs")))


def test_check_layout_finds_the_checkouts_vllm_site_with_no_pythonpath_given(qwen3):
    r = run(["-m", "p2pweights", *CHECK, "--model", qwen3], cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    using = [line for line in r.stderr.splitlines() if line.startswith(USING)]
    assert len(using) == 1 and f"from {VLLM_SITE} " in using[0] and "vLLM 0.33." in using[0], r.stderr
    assert "OK, byte-exact" in r.stdout


def test_check_layout_finds_vllm_through_the_setting_from_another_directory(qwen3, tmp_path):
    r = run(["-m", "p2pweights", *CHECK, "--model", qwen3, "--json"], cwd=tmp_path, P2PW_VLLM_SITE=str(VLLM_SITE))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["equal"] is True
    assert f"{USING}0.33." in r.stderr and f"from {VLLM_SITE} " in r.stderr


def test_a_setting_naming_a_folder_without_vllm_is_one_line_exit_2(qwen3, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run(["-m", "p2pweights", *CHECK, "--model", qwen3], cwd=tmp_path, timeout=60, P2PW_VLLM_SITE=str(empty))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = errors(r.stderr)
    assert len(lines) == 1 and USING not in r.stderr, r.stderr
    for said in ("check-layout --engine-kind vllm", "not importable", f"P2PW_VLLM_SITE={empty}",
                 "scripts/setup.sh"):
        assert said in lines[0], lines[0]


def test_no_vllm_site_anywhere_is_one_line_exit_2_naming_where_it_looked(qwen3, tmp_path):
    """From a folder without .vllm_site above it and the source checkout's .vllm_site out of reach."""
    code = textwrap.dedent(f"""
        import sys
        from p2pweights.replica import vllm_site
        vllm_site._checkout_site = lambda: None
        from p2pweights.cli import main
        sys.exit(main({[*CHECK, "--model", qwen3]!r}))
    """)
    r = run(["-c", code], cwd=tmp_path, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = errors(r.stderr)
    assert len(lines) == 1, r.stderr
    for said in ("check-layout --engine-kind vllm", "not importable", f".vllm_site in {tmp_path.resolve()} and its "
                 "parents", "P2PW_VLLM_SITE is unset", "scripts/setup.sh"):
        assert said in lines[0], lines[0]


def test_demo_finds_vllm_before_its_own_refusals(qwen3, tmp_path):
    """demo --engine-kind vllm: vLLM found (the line), then --transport nixl refused as before (exit 2)."""
    r = run(["-m", "p2pweights", "demo", "--engine-kind", "vllm", "--model", qwen3, "--transport", "nixl"],
            cwd=tmp_path, timeout=120, P2PW_VLLM_SITE=str(VLLM_SITE))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{USING}0.33." in r.stderr
    assert len(errors(r.stderr)) == 1 and "--transport nixl" in errors(r.stderr)[0], r.stderr


def test_a_vllm_commands_modules_come_from_this_environment_and_vllm_site_only(qwen3, tmp_path):
    """After check-layout --engine-kind vllm ran in-process, every imported module lies under sys.prefix,
    .vllm_site, the stdlib or the package's source: never the base interpreter's site-packages or
    the user site (a package a fresh environment lacks would be taken from there)."""
    code = textwrap.dedent(f"""
        import json, os, site, sys, sysconfig
        from p2pweights.cli import main
        rc = main({[*CHECK, "--model", qwen3]!r})
        import vllm.v1.serial_utils, vllm.config  # what every vLLM config reaches
        def roots(*paths):
            return [p for path in paths if path for p in {{os.path.normpath(path), os.path.realpath(path)}}]
        base = {{"base": sys.base_prefix, "platbase": sys.base_prefix}}
        forbidden = roots(sysconfig.get_path("purelib", vars=base), sysconfig.get_path("platlib", vars=base),
                          site.getusersitepackages())
        allowed = roots(sys.prefix, {str(VLLM_SITE)!r}, {str(ROOT / "python")!r},
                        sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"])
        under = lambda f, dirs: any(f == d or f.startswith(d + os.sep) for d in dirs)
        bad = {{}}
        for name, module in list(sys.modules.items()):
            f = getattr(module, "__file__", None)
            if not isinstance(f, str) or not os.path.isabs(f):  # torch.ops' __file__ is "_ops.py"
                continue
            f = os.path.normpath(f)
            if under(f, forbidden) or not under(f, allowed):
                bad[name] = f
        print(json.dumps({{"rc": rc, "modules": len(sys.modules), "bad": bad, "forbidden": forbidden}}))
    """)
    r = run(["-c", code], cwd=tmp_path, P2PW_VLLM_SITE=str(VLLM_SITE))  # an installed wheel has no checkout beside it
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0, r.stdout + r.stderr
    assert out["modules"] > 500  # vLLM's config and model classes were imported
    assert out["bad"] == {}, f"modules from outside this environment and .vllm_site (forbidden: {out['forbidden']}): " \
                             f"{out['bad']}"
