"""``python -m lightning_amp.bench --model bert --level O2``: one benchmark run in this process, JSON to stdout."""
import sys

from lightning_amp.bench.worker import main

sys.exit(main())
