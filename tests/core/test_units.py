"""Sizes read from text and written for people."""

import pytest

from tf_ucudnn.core.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, size", [("64MiB", 64 << 20), ("1.5GiB", 3 << 29), ("512MB", 512e6),
                                        ("1KiB", 1024), (4096, 4096), (" 2 gib ", 2 << 30)])
def test_sizes_are_read(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("size, text", [(512, "512 B"), (1024, "1 KiB"), (64 << 20, "64 MiB"),
                                        (int(15.9 * (1 << 30)), "15.9 GiB"), (1536, "1.5 KiB")])
def test_sizes_are_written_for_people(size, text):
    assert format_bytes(size) == text


def test_a_tiny_budget_is_not_written_as_zero():
    assert format_bytes(1024) != "0.0 MiB" and parse_bytes(format_bytes(1024).replace(" ", "")) == 1024
