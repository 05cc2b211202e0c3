"""Huge pages for torch's big buffers: the switch is set only where it takes effect, and
the status says what happened."""
from __future__ import annotations

import subprocess
import sys

import pytest

from stallfree import huge_pages


@pytest.fixture
def thp(tmp_path, monkeypatch):
    # What this process's own import recorded stays out of the cases below.
    monkeypatch.setattr(huge_pages, "_set_here", False)
    monkeypatch.setattr(huge_pages, "_torch_first", False)

    def setting(mode: str) -> str:
        path = tmp_path / "enabled"
        path.write_text({"always": "[always] madvise never\n",
                         "madvise": "always [madvise] never\n",
                         "never": "always madvise [never]\n"}[mode])
        return str(path)
    return setting


def test_the_switch_is_set_under_madvise_before_torch_loads(thp):
    env: dict[str, str] = {}
    assert huge_pages.request_for_torch(env, torch_loaded=False, path=thp("madvise"))
    assert env == {huge_pages.TORCH_SWITCH: "1"}
    assert huge_pages.status(env, thp("madvise")).startswith("on: THP 'madvise'")


@pytest.mark.parametrize("mode", ["always", "never"])
def test_the_switch_is_left_alone_where_advice_changes_nothing(thp, mode):
    env: dict[str, str] = {}
    assert not huge_pages.request_for_torch(env, torch_loaded=False, path=thp(mode))
    assert env == {}
    assert huge_pages.status(env, thp(mode)).startswith("on" if mode == "always" else "off")


def test_a_late_import_or_the_users_choice_is_not_overridden(thp):
    chosen = {huge_pages.TORCH_SWITCH: "0"}
    assert not huge_pages.request_for_torch(chosen, torch_loaded=False, path=thp("madvise"))
    assert chosen == {huge_pages.TORCH_SWITCH: "0"}
    assert huge_pages.status(chosen, thp("madvise")) == "off: THP_MEM_ALLOC_ENABLE is not 1"
    assert not huge_pages.torch_was_first()
    env: dict[str, str] = {}
    assert not huge_pages.request_for_torch(env, torch_loaded=True, path=thp("madvise"))
    assert env == {} and huge_pages.torch_was_first()  # the engine warns
    assert huge_pages.status(env, thp("madvise")).startswith(
        "off: torch was imported before stallfree")


def test_no_thp_setting_means_off(tmp_path):
    missing = str(tmp_path / "absent")
    assert huge_pages.thp_mode(missing) is None
    assert huge_pages.status({}, missing).startswith("off")


def test_importing_torch_first_is_named_in_the_status():
    """A program that imports torch first: the switch comes too late, and the status (which
    the engine logs as a warning then) says why and what to do."""
    code = ("import torch, stallfree; from stallfree import huge_pages; "
            "print(huge_pages.torch_was_first()); print(huge_pages.status())")
    env = {k: v for k, v in __import__("os").environ.items() if k != huge_pages.TORCH_SWITCH}
    first, status = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, check=True).stdout.splitlines()
    madvise = huge_pages.thp_mode() == "madvise"
    assert first == str(madvise)
    assert status.startswith("off: torch was imported before stallfree") == madvise


def test_importing_stallfree_first_sets_the_switch_for_torch():
    """In a fresh interpreter, as `stallfree serve` starts: the package's import sets the
    switch when this machine's THP mode is madvise, and never loads torch itself."""
    code = ("import os, sys, stallfree; "
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), 'torch' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if k != huge_pages.TORCH_SWITCH}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    expected = "1" if huge_pages.thp_mode() == "madvise" else "None"
    assert out == [expected, "False"]
