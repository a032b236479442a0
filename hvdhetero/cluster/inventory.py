"""The inventory: which hosts train together, how to reach them, and the versions they share.

inventory.yaml is read once, on the launcher, into frozen dataclasses. Every value is checked
at load, so a typo fails here -- naming the file, the line and the key -- rather than minutes
later on a remote host. Loading contacts nothing and writes nothing (it only looks whether an
`identity:` key file exists), and this module imports neither torch nor horovod, so
`invoke --list`, `check` and `--dry-run` start instantly.

    inv = load(default_path())
    for host in inv.select("mac,pc"):
        print(host.name, host.address, host.slots)

The records (Pins, Host, Inventory) live in inventory_records.py, reading and checking the file
in inventory_file.py; this module is the one to import them from.
"""

from hvdhetero.cluster.inventory_file import ENV_VAR, default_path, load
from hvdhetero.cluster.inventory_records import DEVICES, LOCAL_ADDRESSES, TRANSPORTS, Host, Inventory, Pins

__all__ = ["DEVICES", "ENV_VAR", "LOCAL_ADDRESSES", "TRANSPORTS", "Host", "Inventory", "Pins", "default_path", "load"]
