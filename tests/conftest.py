"""Test setup: one Inductor cache for the whole run, inherited by every spawned rank."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".pytest_cache" / "inductor"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
