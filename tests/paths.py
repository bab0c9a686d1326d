from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
TRACES = ROOT.parent / "shared" / "traces"
