"""``python -m ram_trl`` (also what ``accelerate launch -m ram_trl`` runs)."""

from ram_trl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
