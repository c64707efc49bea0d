"""`python -m ssl_vit <command> [args]` = `ssl-vit <command> [args]`; the form launchers take:
`accelerate launch -m ssl_vit pretrain ...`, `torchrun --nproc_per_node 8 -m ssl_vit pretrain ...`."""

from ssl_vit.commands import main

if __name__ == "__main__":
    main()
