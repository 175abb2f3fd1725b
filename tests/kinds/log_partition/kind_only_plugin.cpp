// The log-partition plugin as built before its kind had the setting "sharpness": it names the kind alone, so
// lossverify hands it the setting only at its fallback.
#define LOG_PARTITION_PLUGIN_KIND_ONLY
#include "log_partition_plugin.cpp"  // NOLINT(bugprone-suspicious-include): the same plugin, built a second time
