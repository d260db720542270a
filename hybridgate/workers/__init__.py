"""The engine shared by both worker kinds; the numpy sampler lives in `sampling`."""
