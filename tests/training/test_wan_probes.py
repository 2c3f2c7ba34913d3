"""The synthetic Wan probe's square counter: it must find every square the probe's data draws, and none in noise."""

import numpy as np

from meshserve.training import wan_probes


def test_counts_every_drawn_square_and_none_in_noise():
    rng = np.random.default_rng(0)
    assert wan_probes.count_squares(wan_probes._squares(rng, 16)) == 16
    assert wan_probes.count_squares(rng.normal(size=(16, *wan_probes.GRID, 16))) == 0
    # A square twice the size (12 x 12 = 144 pixels) is not "about a square's size".
    big = np.full((1, *wan_probes.GRID, 16), -0.5, np.float32)
    big[:, :, 2:14, 2:14, :4] = 1.5
    assert wan_probes.count_squares(big) == 0
