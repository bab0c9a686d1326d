from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "testbed" / "conf"
TRACES = ROOT.parent / "shared" / "traces"
