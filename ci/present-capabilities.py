"""Print the capabilities present in this process's bounding set, as apptainer's comma list (CAP_X,CAP_Y)."""

NAMES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE NET_BIND_SERVICE "
    "NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT "
    "SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
    "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE"
).split()


def main() -> None:
    with open("/proc/self/status") as fh:
        bounding = int(next(line for line in fh if line.startswith("CapBnd:")).split()[1], 16)
    print(",".join(f"CAP_{name}" for i, name in enumerate(NAMES) if bounding >> i & 1))


if __name__ == "__main__":
    main()
