#pragma once
// Processes that lossverify's plugins start (a daemon, a `setsid` child, anything that leaves the plugin host's
// process group) never outlive the command: lossverify is their reaper (Linux's child subreaper), so an orphan
// is re-parented to it rather than to init, and every process still under it is ended when the command ends.
namespace lossverify {

// Makes this process the reaper of its orphaned descendants (prctl PR_SET_CHILD_SUBREAPER). Call once, first.
void adopt_orphaned_descendants();

// Ends every child of this process (SIGKILL to it and its process group) and reaps it, round after round while
// orphans re-parented by those deaths arrive. Returns how many it ended.
int end_descendants();

}  // namespace lossverify
