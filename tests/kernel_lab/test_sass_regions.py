"""tools/sass_regions.py on a small CSV in Nsight Compute's source-page layout: the roles
split at the setmaxnreg instructions (out-of-line wait retries counted where they branch back to),
samples summed per role and kind, top instructions ranked."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: tools/
from tools import sass_regions  # noqa: E402

CSV = '''"Kernel Name","RaggedPrefillSm90Kernel"
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)"
"0x0000","S2R R0, SR_TID.X ;","2","1"
"0x0010","USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0 ;","1","1"
"0x0020","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;","40","40"
"0x0030","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR52], RZ, !UPT ;","5","5"
"0x0040","WARPGROUP.DEPBAR.LE gsb0, 0x1 ;","20","20"
"0x0050","FMNMX R1, |R2|, R1, !PT ;","10","3"
"0x0060","STG.E desc[UR40][R154.64], R89 ;","8","8"
"0x0070","USETMAXREG.DEALLOC.CTAPOOL 0x38 ;","0","0"
"0x0080","LDGSTS.E.BYPASS.128 [R5], desc[UR6][R8.64] ;","30","30"
"0x0090","BAR.SYNC.DEFER_BLOCKING 0x4, 0x80 ;","14","14"
'''


def test_roles_kinds_and_ranking(tmp_path):
    path = tmp_path / "sass.csv"
    path.write_text(CSV)
    xs = sass_regions.read_sass_csv(path)
    assert [x.address for x in xs] == [16 * i for i in range(10)]
    roles = sass_regions.role_of(xs)
    assert roles == ["shared"] + ["consumer"] * 6 + ["producer"] * 3
    text = sass_regions.summarize(xs, top=2)
    # 130 samples in all: consumers 84, producer 44, shared 2.
    assert "## consumer: 84 samples (64.6% of the kernel's)" in text
    assert "## producer: 44 samples (33.8% of the kernel's)" in text
    assert "| mbarrier wait | 40 | 47.6% |" in text
    assert "| wgmma wait | 20 | 23.8% |" in text
    assert "| global store | 8 | 9.5% |" in text
    assert "| async copy | 30 | 68.2% |" in text
    assert "| named barrier | 14 | 31.8% |" in text
    # Top 2 of the consumers: the mbarrier wait, then the wgmma wait; the FMNMX (10) is third.
    consumer = text.split("## producer")[0]
    assert consumer.index("0x0020") < consumer.index("0x0040")
    assert "0x0050 |" not in consumer.split("| address |")[1]


def test_out_of_line_wait_retry_counts_for_the_role_it_returns_to(tmp_path):
    # A consumer wait's retry loop placed after the producer's code, branching back to 0x0020.
    tail = ('"0x00a0","SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR15], R190 ;","25","25"\n'
            '"0x00b0","@!P1 BRA 0xa0 ;","3","3"\n'
            '"0x00c0","BRA 0x20 ;","0","0"\n')
    path = tmp_path / "sass.csv"
    path.write_text(CSV + tail)
    roles = sass_regions.role_of(sass_regions.read_sass_csv(path))
    assert roles == ["shared"] + ["consumer"] * 6 + ["producer"] * 3 + ["consumer"] * 3


def test_main_reports_an_empty_csv(tmp_path, capsys):
    path = tmp_path / "empty.csv"
    path.write_text('"# Address","Source","Warp Stall Sampling (All Samples)"\n')
    assert sass_regions.main([str(path)]) == 1


def test_samples_by_the_unit_of_work_an_instruction_runs_once_for(tmp_path):
    """--units: "Instructions Executed" / the role's warps per unit names what an instruction runs
    once for (x1, x2, x4 unrolled); 3 work tiles and 12 key tiles, 8 consumer and 4 producer
    warps."""
    csv_text = '''"# Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x0000","USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0 ;","0","24"
"0x0010","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;","30","24"
"0x0020","HGMMA.64x128x16.F32.BF16 R24, gdesc[UR52], RZ, !UPT ;","50","96"
"0x0030","STG.E desc[UR40][R154.64], R89 ;","10","48"
"0x0040","FMNMX R1, R2, R1, !PT ;","5","7"
"0x0050","USETMAXREG.DEALLOC.CTAPOOL 0x38 ;","0","12"
"0x0060","LDGSTS.E.BYPASS.128 [R5], desc[UR6][R8.64] ;","40","192"
'''
    path = tmp_path / "sass.csv"
    path.write_text(csv_text)
    xs = sass_regions.read_sass_csv(path)
    assert [x.executed for x in xs] == [24, 24, 96, 48, 7, 12, 192]
    text = sass_regions.by_unit(xs, {"work tile": 3, "key tile": 12},
                                {"consumer": 8, "producer": 4})
    consumer, producer = text.split("## producer")
    # consumers (95 samples): 24 = 3 x 8 and 48 = 3 x 8 x 2 per work tile (40); 96 = 12 x 8 per
    # key tile (50); 7 matches nothing (5)
    assert "| work tile | 40 | 42.1% |" in consumer
    assert "| key tile | 50 | 52.6% |" in consumer
    assert "| other | 5 | 5.3% |" in consumer
    # producer: 192 = 12 x 4 x 4 (unrolled 4x) per key tile
    assert "| key tile | 40 | 100.0% |" in producer
