"""Every capacity option of the plugin at once, as the GPU hardening and TP tests run it."""

EVERY_CAPACITY_OPTION = {
    "dspark_capacity": "sps",
    "dspark_varlen_verify": True,
    "dspark_dynamic_depth": True,
    "dspark_online_sts": True,
    "dspark_confidence_metrics": True,
    "dspark_plain_steps": True,
}
