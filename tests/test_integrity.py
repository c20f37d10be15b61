"""The checkpoint seal (`files.json`) on its own: every kind of damage it must name.

The checkpoint tests damage real Orbax checkpoints, where the reader may also notice
(a flipped byte of compressed data fails to decode); here only the seal can tell,
so a check that stopped comparing CRCs fails.
"""

import zlib

import pytest

from eqgpt.train.integrity import DamagedFileError, crc32, verify_files, write_manifest


@pytest.fixture
def sealed(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "a.bin").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "d" / "b.bin").write_bytes(b"eqgpt" * 100)
    write_manifest(tmp_path)
    return tmp_path


def test_intact_files_pass_and_the_crc_is_zlibs(sealed):
    assert verify_files(sealed) is True
    assert crc32(sealed / "d" / "b.bin") == zlib.crc32(b"eqgpt" * 100)


@pytest.mark.parametrize("damage, message", [
    ("flip", "has other bytes than when saved"),  # same size: only the CRC can tell
    ("truncate", "has 5000 bytes, 10240 when saved"),
    ("remove", "is missing"),
])
def test_each_damage_is_named(sealed, damage, message):
    f = sealed / "a.bin"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[1234] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[:5000]))
    else:
        f.unlink()
    with pytest.raises(DamagedFileError, match=f"a.bin {message}" if damage != "remove" else "a.bin is missing"):
        verify_files(sealed)


def test_no_seal_is_not_checked(tmp_path):
    (tmp_path / "x").write_bytes(b"1")
    assert verify_files(tmp_path) is False
