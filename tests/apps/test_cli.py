import subprocess
import sys


def test_help_imports_nothing_heavy():
    code = ("import sys, hotloop.cli as c\n"
            "try:\n    c.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'vllm', 'peft', 'ray', 'transformers') if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out
    assert "models" in out and "bench" in out and "train" in out


def test_unknown_command_fails_clearly():
    r = subprocess.run([sys.executable, "-m", "hotloop.cli", "frobnicate"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "invalid choice" in r.stderr
