"""MediaLimits: each limit refuses what it should, with a message naming the size, the limit and its owner."""
from __future__ import annotations

from mmrl.data.media_limits import MediaLimits


def test_each_limit_and_its_message() -> None:
    limits = MediaLimits(max_aspect_ratio=10, min_side=4, max_pixels=10_000, min_video_frames=2, owner="the x processor")
    assert limits.image_problem(40, 40) is None and limits.video_problem(2, 40, 40) is None
    assert "shorter side 3 < 4, the minimum of the x processor" in limits.image_problem(30, 3)
    assert "aspect ratio 11.0 > 10" in limits.image_problem(44, 4)
    assert "10201 pixels > 10000" in limits.image_problem(101, 101)
    assert "1 decoded frame(s) < 2" in limits.video_problem(1, 40, 40)
    assert limits.video_problem(4, 44, 4).startswith("frames 44x4: aspect ratio")
    assert MediaLimits().image_problem(1, 10_000) is None  # no limits declared: nothing refused
