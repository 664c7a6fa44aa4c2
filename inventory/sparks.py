"""An example fleet: copy it, then list your Sparks.

    pyinfra inventory/sparks.py deploy.py

Each entry is a host name or (host name, host data). Host data wins over
group_data/*.py and loses to --data. Keys starting with ssh_ are pyinfra's
connection settings; every other key is validated against sparkfleet/config.py.
"""

sparks = [
    # A Spark reached with your SSH agent or ~/.ssh/config, serving the default profile.
    ("spark-01.lab.example", {"ssh_user": "root"}),
    # A second Spark whose HF cache lives on its bigger NVMe, serving the dflash profile.
    (
        "spark-02.lab.example",
        {
            "ssh_user": "admin",
            "_sudo": True,
            "hf_home": "/mnt/nvme/hf",
            "profile": "dflash",
        },
    ),
]
