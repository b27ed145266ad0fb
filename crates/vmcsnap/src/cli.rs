//! Command-line arguments.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use vmcsnap_control::{RejuvenateMode, SnapshotMode};

/// Hot snapshots and fast restore for clusters of QEMU/KVM virtual machines.
#[derive(Debug, Parser)]
#[command(name = "vmcsnap", version, about, long_about = None)]
pub struct Cli {
    /// The agent's run directory [default: $VMCSNAP_RUN_DIR, /var/lib/vmcsnap for root,
    /// else ~/.local/state/vmcsnap]
    #[arg(long, global = true, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Boot the cluster described by SPEC (TOML, see docs/cluster-spec.md) and
    /// return when every VM is ready; the cluster keeps running.
    Up {
        /// The cluster spec.
        spec: PathBuf,
        /// Print one JSON object {"cluster", "vms": [{name, pid, boot_ms, accel, ip, mac}]}.
        #[arg(long)]
        json: bool,
    },
    /// Show the VMs and the switch counters of the running cluster.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Print a VM's serial console output.
    Console {
        /// The VM's name.
        vm: String,
        /// Print only the last BYTES bytes (0: everything).
        #[arg(long, default_value_t = 0)]
        bytes: u64,
    },
    /// Stop every VM of the cluster and remove its sockets, RAM files and disks.
    Down {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove what interrupted or failed operations left behind: snapshot
    /// temporary directories and frozen disks of snapshots never committed
    /// (kept while a VM's disk still uses them), and cached disk indexes
    /// (<run-dir>/disk-index) of files no snapshot and no VM has any more.
    Gc {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Restart the hypervisor layer (QEMU) of VMs without losing them:
    /// warm keeps guest RAM in place, saved goes through disk, cold reboots.
    Rejuvenate {
        /// Only this VM.
        #[arg(long, conflicts_with = "all", required_unless_present = "all")]
        vm: Option<String>,
        /// Every VM of the cluster, in parallel.
        #[arg(long)]
        all: bool,
        /// warm | saved | cold | cpr (QEMU 10.0's cpr-transfer: the new QEMU starts beside
        /// the old one; needs 10.0 on both sides and a VM made ready by a warm restart on 10.0)
        #[arg(long, value_enum, default_value_t = RejuvenateMode::Warm, hide_possible_values = true)]
        mode: RejuvenateMode,
        /// The QEMU binary to restart on (default: VMCSNAP_QEMU, else the agent's). Another
        /// version upgrades the VM's QEMU (7.2 -> 10.0) with the guest kept; a move QEMU
        /// cannot make (a downgrade) is refused before the VM is touched.
        #[arg(long, value_name = "PATH")]
        qemu: Option<PathBuf>,
        /// Instead of a restart: start again a VM whose restart failed (its QEMU is gone,
        /// its state kept), with VMCSNAP_QEMU or the installed QEMU, then the kept copy
        /// of the QEMU it ran before.
        #[arg(long, conflicts_with = "rollback")]
        resume: bool,
        /// Like --resume, but only on the kept copy of the QEMU the VM ran before.
        #[arg(long)]
        rollback: bool,
        /// Testing (a `fault-injection` build only): `--inject-fault FAULT`.
        #[command(flatten)]
        fault: crate::fault_arg::RejuvenateFault,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Snapshot a running VM (memory and disk frozen in one pause) into
    /// <run-dir>/snapshots/NAME: hot (background snapshot, pause of
    /// milliseconds), stop-copy (paused while copying) or precopy (live copy).
    /// With --cluster, every VM at once, consistently: HotSnap's coordinated
    /// protocol, with frames in flight at the cut logged in the snapshot.
    Snapshot {
        /// The VM's name.
        #[arg(required_unless_present = "cluster", conflicts_with = "cluster")]
        vm: Option<String>,
        /// Snapshot the whole cluster (a cluster snapshot: cluster.json,
        /// channel-state.bin and one snapshot per VM under vms/).
        #[arg(long)]
        cluster: bool,
        /// hot | stop-copy | precopy
        #[arg(long, value_enum, default_value_t = SnapshotMode::Hot, hide_possible_values = true)]
        mode: SnapshotMode,
        /// Snapshot name [default: VM-UNIXTIME, or CLUSTER-UNIXTIME].
        #[arg(long)]
        name: Option<String>,
        /// Debug: copy guest RAM to PATH while the VM is paused for the snapshot.
        #[arg(long, hide = true, value_name = "PATH", conflicts_with = "cluster")]
        reference: Option<PathBuf>,
        /// Testing (a `fault-injection` build only): `--inject-fault FAULT`.
        #[command(flatten)]
        fault: crate::fault_arg::SnapshotFault,
        /// How the memory image is stored: zstd (default: compressed locality blocks, equal
        /// pages once, page-cache pages as references to the frozen disk), lz4 (faster codec,
        /// larger image), none (no compression), v1 (image
        /// format 1.0, for older vmcsnap releases) or lz4-random (a benchmark control: LZ4
        /// blocks of pages scattered at random, no locality). With ",no-disk" (or "no-disk"
        /// alone): pages that are on the frozen disk are stored as bytes too (no detection
        /// layer).
        #[arg(long, value_name = "STORAGE", conflicts_with = "cluster")]
        storage: Option<vmcsnap_control::ImageStorage>,
        /// Store every page. By default a snapshot of a VM that already has one is
        /// incremental: it stores only the pages that differ from the VM's newest snapshot
        /// (its parent, read on restore), up to a chain of 8, then a full one again.
        #[arg(long, conflicts_with = "cluster")]
        full: bool,
        /// Pages per locality block of the memory image (1-4096; default 64, 256 KiB): a
        /// demand fault on restore loads its page's whole block. For tuning, see docs/restore.md.
        #[arg(long, value_name = "N", conflicts_with = "cluster",
              value_parser = clap::value_parser!(u16).range(1..=4096))]
        block_pages: Option<u16>,
        /// Record which pages the guest accesses, reads included, for SECS once the
        /// snapshot's copy of guest RAM is over (into the snapshot's
        /// access/accessed.json, written in the background after the snapshot returns);
        /// a restore loads them early. Needs the host kernel's DAMON (6.12+, root);
        /// without it the snapshot says why it has no access data. 0: off. See
        /// docs/access-data.md.
        #[arg(
            long,
            value_name = "SECS",
            default_value_t = 10,
            conflicts_with = "cluster"
        )]
        access_window: u64,
        /// With --cluster: cut each VM once its QEMU read everything sent to it, without
        /// checking (cut probes) that QEMU handed it all to the guest; frames QEMU still held
        /// are then missing from a restore. To measure what the probes change.
        #[arg(long, requires = "cluster")]
        no_cut_probes: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Restore a VM from a snapshot through postcopy: QEMU starts with only
    /// the pages the mode loads up front and fetches the rest on demand and
    /// in the background. Joins the running cluster (or starts one). With
    /// --cluster, every VM of a cluster snapshot into a new cluster.
    /// Returns once every guest runs (`vmcsnap status` shows the background
    /// load; other commands wait for it), or with --wait once every page is in.
    Restore {
        /// The snapshot's name (see `vmcsnap snapshots`).
        snapshot: String,
        /// Restore every VM of a cluster snapshot into a new cluster (no
        /// cluster may be up), in restore-line order.
        #[arg(long)]
        cluster: bool,
        /// One VM [default: workingset]: eager (everything first) | lazy (nothing first) |
        /// workingset (HotRestore's FAFL working set) | sampling-ws (sampled size, no FAFL order).
        /// --cluster [default: hotrestore-rl]: eager (each VM on its own, all memory first) |
        /// eager-rl (all memory first, starts in restore-line order) |
        /// workingset-restore (each VM on its own, sampled working set) | hotrestore (elastic working set, no restore line) | hotrestore-rl
        /// (LP-revised working sets, starts in restore-line order).
        #[arg(long, value_parser = ["eager", "lazy", "workingset", "sampling-ws", "eager-rl", "workingset-restore", "hotrestore", "hotrestore-rl"])]
        mode: Option<String>,
        /// Working-set size in pages, or `auto` (HotRestore: (0.7 sample + 0.3 snapshot) / 2).
        #[arg(long, default_value = "auto", conflicts_with = "cluster")]
        wss: String,
        /// Keep the guest paused once its state is loaded (`cont` it with QMP).
        #[arg(long, conflicts_with = "cluster")]
        paused: bool,
        /// Record the restore's first accesses for `analyze-ws` (use with --mode lazy --no-background).
        #[arg(long, conflicts_with = "cluster")]
        trace: bool,
        /// Send only the pages the guest asks for during the first 10 s.
        #[arg(long, conflicts_with = "cluster")]
        no_background: bool,
        /// Leave CPU priorities alone (by default, as root, serving faults runs above the guests' vCPUs and background loading below them).
        #[arg(long)]
        no_priorities: bool,
        /// After each guest starts, serve only the pages it faults on for MS milliseconds, then
        /// load the rest in the background, so that the CPU goes to the guests that just started
        /// [default: 1000 with --cluster, else 0].
        #[arg(long, value_name = "MS")]
        start_quiet: Option<u64>,
        /// Locality blocks read ahead after a demand fault's own block (0-64; default 1). For
        /// tuning, see docs/restore.md.
        #[arg(long, value_name = "N", conflicts_with = "cluster",
              value_parser = clap::value_parser!(u32).range(0..=64))]
        prefetch_blocks: Option<u32>,
        /// Send the pages the guest faults on over QEMU's postcopy-preempt channel, a second
        /// connection, so that they never wait behind background pages (QEMU 10.0 only; for
        /// what it gains, see docs/restore.md).
        #[arg(long, conflicts_with = "cluster")]
        preempt: bool,
        /// Testing (a `fault-injection` build only): `--inject-fault FAULT`.
        #[command(flatten)]
        fault: crate::fault_arg::RestoreFault,
        /// Return once every page is loaded, with the full report (full load time, demand
        /// faults, hit rate, TCP counters), instead of once every guest runs.
        #[arg(long)]
        wait: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stop one VM of the running cluster; the others run on.
    Stop {
        /// The VM's name.
        vm: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Hit rate and accuracy of a snapshot's FAFL working set at 0.25x to 2x
    /// the computed size, against its newest traced restore.
    AnalyzeWs {
        /// The snapshot's name.
        snapshot: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the snapshots of the run directory (as `snapshots list`), or
    /// delete or prune them.
    #[command(args_conflicts_with_subcommands = true)]
    Snapshots {
        #[command(subcommand)]
        cmd: Option<SnapshotsCmd>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a snapshot's manifest and page statistics; --verify checks what a restore checks.
    /// A cluster snapshot shows its VMs, timeline, W(i,j) edges and counters.
    Inspect {
        /// A snapshot name (under <run-dir>/snapshots) or a snapshot directory.
        snapshot: PathBuf,
        /// The snapshot is a cluster snapshot (detected anyway when it has cluster.json).
        #[arg(long)]
        cluster: bool,
        /// Cluster snapshot: print HotRestore's restore dependency graph (edges, rings,
        /// orphans, causal order, LP-revised working sets, restore line).
        #[arg(long)]
        rdg: bool,
        /// With --rdg: write the graph as Graphviz DOT to FILE (and FILE.png if `dot` is installed).
        #[arg(long, value_name = "FILE", requires = "rdg")]
        dot: Option<PathBuf>,
        /// Check everything a restore checks: every block and CRC, every page through the
        /// parent snapshots and frozen disks (no absent page), the page hashes; exit
        /// non-zero naming each bad block and page.
        #[arg(long)]
        verify: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Measure the floor of a hot snapshot's pause for VM on this host: QEMU's
    /// own background snapshot of it with nothing else done (no disk snapshot,
    /// memory straight to /dev/null, nothing kept). The guest runs on.
    PauseLimit {
        /// The VM's name.
        vm: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Availability of warm, cold and saved VMM rejuvenation (the warm-VM
    /// reboot paper's equations 1-2) from downtimes measured on this host by
    /// earlier `rejuvenate` runs.
    Availability {
        /// Days between two VMM rejuvenations.
        #[arg(long, value_name = "DAYS")]
        t_vmm: f64,
        /// Days between two OS rejuvenations.
        #[arg(long, value_name = "DAYS")]
        t_os: f64,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// (internal) QEMU's end of a snapshot stream: copies stdin to the
    /// agent's socket and drains the rest if the agent goes away.
    #[command(hide = true)]
    StreamRelay {
        /// The agent's capture socket.
        #[arg(long)]
        to: PathBuf,
        /// Fork and let the parent exit at once: the relay is then nobody's
        /// child but init's (or the nearest subreaper's), so it is reaped
        /// even if the agent that started it re-executes or dies.
        #[arg(long)]
        detach: bool,
    },
    /// (internal) The page source of a restore: serves QEMU's postcopy
    /// stream (stdin) from the plan in DIR, and survives the agent (see
    /// docs/restore.md, "The page source").
    #[command(hide = true)]
    PageSource {
        /// The restore's page-source directory (`<vm-dir>/page-source`).
        #[arg(long)]
        dir: PathBuf,
        /// Fork and let the parent exit once it has written the pid file:
        /// the page source is then nobody's child but init's.
        #[arg(long)]
        detach: bool,
    },
    /// Run CMD inside the cluster's network namespace, where the host
    /// interface 10.77.0.1/24 reaches the VMs (`vmcsnap exec -- redis-cli -h
    /// 10.77.0.2`). Stdio is inherited; exits with CMD's exit code.
    Exec {
        /// The command and its arguments (put them after `--`).
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        argv: Vec<OsString>,
    },
    /// Manage the per-host agent that owns the QEMU processes and the switch.
    Agent {
        #[command(subcommand)]
        cmd: AgentCmd,
    },
    /// Build (or find in the cache) the guest kernel, initramfs and programs.
    Guest {
        #[command(subcommand)]
        cmd: GuestCmd,
    },
    /// Build and list Debian images (systemd, Redis, ...) for real-distro VMs.
    Image {
        #[command(subcommand)]
        cmd: ImageCmd,
    },
}

#[derive(Debug, Subcommand)]
pub enum SnapshotsCmd {
    /// List the snapshots of the run directory (what `vmcsnap snapshots` does).
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete snapshots (per-VM or cluster snapshots, by the names `vmcsnap
    /// snapshots` lists) with their frozen disks.
    ///
    /// Each is renamed away first: an interruption leaves it whole, or a temporary directory
    /// that `vmcsnap gc` removes. Frozen disks that a running VM (one
    /// restored from the snapshot) or another snapshot still reads stay and
    /// are reported as kept; `vmcsnap gc` removes them once unused. A VM's
    /// snapshot inside a cluster snapshot is not deleted alone.
    Delete {
        /// The snapshots' names.
        #[arg(required = true, value_name = "NAME")]
        names: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Keep the N newest committed snapshots of each VM, and the N newest
    /// cluster snapshots of each cluster; delete the others.
    ///
    /// They are deleted as `delete` does. Newest by the commit time in the manifest. Invalid snapshots
    /// are left alone (delete them by name).
    Prune {
        /// How many snapshots to keep per VM (and per cluster). 0 deletes
        /// every snapshot of a VM, and is refused without --vm.
        #[arg(long, value_name = "N")]
        keep: u32,
        /// Only this VM's snapshots (cluster snapshots are left alone).
        #[arg(long)]
        vm: Option<String>,
        /// Print what would be deleted; delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum ImageCmd {
    /// Build an image into the cache ($VMCSNAP_CACHE or ~/.cache/vmcsnap), as root.
    /// NAME is a built-in recipe (base, redis) or a new name for base plus --packages.
    Build {
        /// Recipe name.
        name: String,
        /// Debian release: bookworm (12, kernel 6.1) or trixie (13, kernel
        /// 6.12); each is cached apart (a VM asks with image_suite).
        #[arg(long, default_value = "bookworm", value_name = "SUITE")]
        suite: vmcsnap_guest::image::Suite,
        /// Debian packages to add (comma-separated).
        #[arg(long, value_delimiter = ',', value_name = "P,...")]
        packages: Vec<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the images in the cache.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum AgentCmd {
    /// Run the agent in the foreground. One agent per run directory: if
    /// another one already serves it, exits with code 75 naming it.
    Run {
        /// Exit as soon as no cluster is up after a request.
        #[arg(long)]
        exit_when_idle: bool,
        /// (internal) Continue from the handover file of `agent restart`.
        #[arg(long, hide = true, value_name = "FILE")]
        resume: Option<PathBuf>,
        /// Serve per-VM metrics (pause, backoff, snapshot bytes, restore
        /// latency, demand faults, rejuvenation downtime) in the Prometheus
        /// text format at http://ADDR/metrics, e.g. 127.0.0.1:9187. An agent
        /// the CLI starts on demand (or `agent restart` starts) takes it
        /// from $VMCSNAP_METRICS_LISTEN instead.
        #[arg(long, value_name = "ADDR")]
        metrics_listen: Option<std::net::SocketAddr>,
        /// How the agent writes its log: `text` (default) or `json` (one
        /// object a line, with the fields of the operation's span: operation,
        /// vm, snapshot). An agent the CLI starts on demand takes it from
        /// $VMCSNAP_LOG_FORMAT instead.
        #[arg(long, value_enum, value_name = "FORMAT")]
        log_format: Option<LogFormat>,
    },
    /// Restart the agent in place (a new build of vmcsnap takes over); the
    /// VMs, their QMP sockets and the switch's connections are kept.
    Restart,
    /// Start the agent in the background (if not running).
    Start,
    /// Stop the agent (refused while a cluster is up).
    Stop,
}

/// The agent's log format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object a line.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum GuestCmd {
    /// Build the guest assets into the cache ($VMCSNAP_CACHE or ~/.cache/vmcsnap).
    Build {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    /// `restore --help` states the agent's default quiet time in words.
    #[test]
    fn restore_help_states_the_agents_cluster_start_quiet() {
        let mut cli = super::Cli::command();
        let help = cli
            .find_subcommand_mut("restore")
            .expect("restore")
            .render_long_help()
            .to_string();
        let ms = vmcsnap_agent::restore::CLUSTER_START_QUIET.as_millis();
        assert!(
            help.contains(&format!("default: {ms} with --cluster")),
            "{help}"
        );
    }

    /// `exec` hands everything after `--` (options included) to the command.
    #[test]
    fn exec_takes_the_command_line_after_the_separator() {
        use clap::Parser;
        let cli = super::Cli::try_parse_from([
            "vmcsnap",
            "exec",
            "--run-dir",
            "/r",
            "--",
            "redis-cli",
            "-h",
            "10.77.0.2",
        ])
        .unwrap();
        assert_eq!(cli.run_dir.as_deref(), Some(std::path::Path::new("/r")));
        let super::Command::Exec { argv } = cli.command else {
            panic!("not exec")
        };
        assert_eq!(argv, ["redis-cli", "-h", "10.77.0.2"]);
        assert!(
            super::Cli::try_parse_from(["vmcsnap", "exec"]).is_err(),
            "a command is required"
        );
    }

    /// `snapshots` lists with or without `list`; `delete` needs a name,
    /// `prune` a --keep.
    #[test]
    fn snapshots_subcommands_parse() {
        use super::{Cli, Command, SnapshotsCmd};
        use clap::Parser;
        let parse = |args: &[&str]| {
            let mut v = vec!["vmcsnap", "snapshots"];
            v.extend_from_slice(args);
            Cli::try_parse_from(v).map(|c| match c.command {
                Command::Snapshots { cmd, json } => (cmd, json),
                other => panic!("{other:?}"),
            })
        };
        assert!(matches!(parse(&["--json"]), Ok((None, true))));
        assert!(matches!(
            parse(&["list", "--json"]),
            Ok((Some(SnapshotsCmd::List { json: true }), false))
        ));
        let Ok((Some(SnapshotsCmd::Delete { names, json }), _)) = parse(&["delete", "a", "b"])
        else {
            panic!("delete")
        };
        assert_eq!((names, json), (vec!["a".to_string(), "b".into()], false));
        assert!(parse(&["delete"]).is_err(), "a name is required");
        let Ok((
            Some(SnapshotsCmd::Prune {
                keep,
                vm,
                dry_run,
                json,
            }),
            _,
        )) = parse(&["prune", "--keep", "2", "--vm", "a", "--dry-run", "--json"])
        else {
            panic!("prune")
        };
        assert_eq!(
            (keep, vm.as_deref(), dry_run, json),
            (2, Some("a"), true, true)
        );
        assert!(parse(&["prune"]).is_err(), "--keep is required");
        assert!(parse(&["--json", "delete", "a"]).is_err());
    }
}
