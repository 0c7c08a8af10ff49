"""``python -m ram_trl`` (also what ``accelerate launch -m ram_trl`` runs)."""

from ram_trl.cli import main

if __name__ == "__main__":
    # under torchrun / accelerate launch, a gloo group's threads can outlive destroy_process_group: exit without the
    # interpreter's finalization then, which they can abort (ram_trl.distributed.exit_distributed, docs/ci.md)
    from ram_trl.distributed import exit_distributed

    exit_distributed(main())
