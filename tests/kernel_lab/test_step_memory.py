"""tools/step_memory.py: the serving step writes the donated pools in place (both aliased to its
outputs, no pool-sized temporary), with bf16 and FP8 weights and K/V, on the CPU."""

import pytest

from tools import step_memory


@pytest.mark.parametrize("quantize", ["none", "fp8"])
def test_the_serving_step_aliases_both_pools_and_copies_neither(quantize):
    rows = step_memory.main(["--layers", "2", "--pages", "300", "--batch", "4", "--chunk", "16",
                             "--quantize", quantize])
    assert len(rows) == 4 and not any("error" in r for r in rows), rows
    for r in rows:
        assert r["alias_gib"] == pytest.approx(2 * r["pool_gib"]), r
        assert r["output_gib"] >= r["alias_gib"], r
        assert r["pool_copies"] == 0, r


def test_pool_copies_finds_a_copy_of_a_pool_shaped_array():
    hlo = ("  %copy.3 = f8e4m3fn[2,300,16,8,128]{4,3,2,1,0} copy(f8e4m3fn[2,300,16,8,128]{4,3,2,1,0} %p)\n"
           "  %copy.4 = bf16[16,4096]{1,0} copy(bf16[16,4096]{1,0} %x)\n")
    assert len(step_memory.pool_copies(hlo, (2, 300, 16, 8, 128))) == 1
