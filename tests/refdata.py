"""Where the tests find the public reference data (tests/data, a copy of the shared reference set)."""

from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
CHINCHILLA = DATA / "chinchilla" / "svg_extracted_data.csv"
MULTIPOWER = DATA / "multipower"
