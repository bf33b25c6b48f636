"""The short version of the long random run (``tools/random_run.py``; the long one is
``python -m tools.random_run --ops 100000 --seed N --hot paged|arena|both``).

Fixed seeds (printed), a few thousand operations over both hot tiers: windows (absolute rows
and rings), prefix reuse, the device, host and disk tiers, suspend and resume, failed and
aborted steps, cancellations mid-step, truncations, raising observers, disk faults, with a new
random configuration every few hundred operations. After every operation the manager's
invariants and the content oracle of ``test_manager.py`` (every cached K/V value of every active
sequence equals what the fake model wrote) hold. The last test breaks one guard (the prefix tree's token check,
under colliding keys) and requires the run to fail, naming its seed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tools/

from tools.random_run import RandomRun, RunFailure

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:KVCacheManager")]


# NOTE: seeds chosen so that every feature below does real work (a change to the run's random
# choices reshuffles them: pick again with the loop in this test's history if one stops covering)
@pytest.mark.parametrize("hot,seed,ops", [("paged", 103, 1500), ("arena", 103, 1500)])
def test_short_random_run(hot, seed, ops):
    print("seed", seed, "hot", hot)
    run = RandomRun(seed, hot, episode_ops=300)
    counts = run.run(ops)
    print(dict(sorted(counts.items())))
    assert run.ops_done == ops
    # every feature did real work
    for key in ("steps", "added", "reused", "suspended", "resumed", "aborted", "cancelled",
                "closed", "compacted", "oop", "values_checked", "ring_checked",
                "num_window_released_pages", "evicted_to_host", "evicted_to_disk",
                "num_onboarded_pages", "num_observer_errors", "num_disk_write_errors",
                "windowed_episodes", "ring_episodes", f"episodes_{hot}", "truncated"):
        assert counts[key] > 0, (key, dict(counts))
    if hot == "paged":
        assert counts["lost"] > 0                    # consumed pools lose the device
    else:
        assert counts["arena_adoptions"] > 0 and counts["arena_num_unmap_calls"] > 0


def test_a_broken_guard_fails_the_run_and_names_the_seed(monkeypatch):
    """Every prefix key collides and the tree stops checking a hit's tokens: some admission
    reuses another prompt's pages, and the content oracle must stop the run."""
    from jax_kvcm._prefix_tree import PrefixTree

    def unchecked_match(self, tokens, salt, page_size, max_pages):  # keys only
        out, key = [], b""
        for p in range(max_pages):
            key = self.key(key, tokens[p * page_size:(p + 1) * page_size], salt)
            if key not in self.nodes:
                break
            out.append(self.nodes[key])
        return out

    monkeypatch.setattr(PrefixTree, "match", unchecked_match)
    run = RandomRun(7, "both", episode_ops=300, const_hash_p=1.0)
    with pytest.raises(RunFailure, match="random run FAILED: seed 7") as e:
        run.run(3000)
    print(str(e.value)[:2000])
    assert run.ops_done < 3000
