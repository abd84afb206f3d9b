"""``python -m robe_torchrec.train [overrides]``: see :mod:`robe_torchrec.train.app`."""

from robe_torchrec.train.app import main

if __name__ == "__main__":
    main()
