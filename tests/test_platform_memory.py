"""What the import's memory check reads as free memory on each platform: it must never
read 0 ("unknown", which turns the check off) where the platform can tell."""

from __future__ import annotations

import builtins
import os

import cluster.platform as platform


def _no_proc(monkeypatch):
    real_open = builtins.open

    def fake_open(path, *a, **k):
        if str(path) == "/proc/meminfo":
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)


def test_macos_counts_its_free_and_reclaimable_pages(monkeypatch):
    _no_proc(monkeypatch)
    monkeypatch.setattr(platform.sys, "platform", "darwin")
    values = {"hw.pagesize": 16384, "vm.page_free_count": 1000, "vm.page_speculative_count": 200,
              "vm.page_pageable_external_count": 3000}
    monkeypatch.setattr(platform, "darwin_sysctl", values.get)
    assert platform.available_memory() == 16384 * 4200


def test_without_a_count_of_free_pages_all_of_ram_bounds_the_check(monkeypatch):
    _no_proc(monkeypatch)
    monkeypatch.setattr(platform.sys, "platform", "darwin")
    monkeypatch.setattr(platform, "darwin_sysctl", lambda name: None)
    real = os.sysconf

    def sysconf(name):
        if name == "SC_AVPHYS_PAGES":  # macOS has no such name
            raise ValueError(name)
        return real(name)

    monkeypatch.setattr(platform.os, "sysconf", sysconf)
    assert platform.available_memory() == real("SC_PAGE_SIZE") * real("SC_PHYS_PAGES") > 0


def test_a_sysctl_this_machine_lacks_is_none():
    assert platform.darwin_sysctl("vm.no_such_counter_here") is None
