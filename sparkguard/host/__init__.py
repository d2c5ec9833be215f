"""Host set-up: the commands a Spark owner runs once after ``pip install``.

* ``sparkguard install`` / ``uninstall`` (:mod:`sparkguard.host.install`): units, sysctl
  file, zram boot configuration and the default config file, under ``/`` or ``--root``.
* ``sparkguard install-zram`` (:mod:`sparkguard.host.zram` now, :mod:`~sparkguard.host.zramboot` at boot,
  :mod:`~sparkguard.host.zramdev` reading devices): a zram swap now and at boot.
* ``sparkguard tune`` (:mod:`sparkguard.host.sysctl`): the memory sysctls, now and at boot.
* ``sparkguard doctor`` (:mod:`sparkguard.host.doctor`): checks the host against what the
  guard needs.

The files they install live in the top-level ``systemd/``, ``sysctl.d/`` and ``zram/``
folders of the source tree and ship as package data under ``sparkguard/data/host/``
(:mod:`sparkguard.host.files`).
"""

#: zram swap defaults (FIELD-NOTES: 6 GiB at priority 100 turned livelocks into restarts);
#: here so that the command-line module can show them without importing anything
ZRAM_DEFAULT_SIZE = 6 * 1024**3
ZRAM_DEFAULT_PRIORITY = 100
ZRAM_DEFAULT_ALGORITHM = "lz4"
