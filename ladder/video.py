"""Videos: an MP4 writer for the frames a script draws."""

from __future__ import annotations

import os


def video_writer(path: str, fps: int):
    """An MP4 writer (imageio's ffmpeg, H.264): `append_data(frame)` for each RGB frame (H, W, 3) uint8, then close."""
    import imageio.v2 as imageio

    os.makedirs(os.path.dirname(path), exist_ok=True)
    return imageio.get_writer(path, fps=fps, macro_block_size=2)  # odd sides padded to even, as H.264 needs
