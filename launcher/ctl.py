"""``hvd-edl-ctl``: drive a running ``hvd-edl-run`` job (placeholder, being written)."""


def main():
    raise SystemExit("hvd-edl-ctl: not implemented yet")
