// A read lease as a shrink watch: the cheap way for a mapped file to know it was not cut.
//
// A mapping reads the cut tail of a file's last page as zeros, so a reader of mapped files
// checks after each batch of reads that no file it read shrank (RandomAccessFile::
// CheckNotShrunk): one fstat per file. With many files a batch (token shards), those fstats
// are most of a small batch's cost. A read lease (fcntl F_SETLEASE F_RDLCK) makes them
// unnecessary while it holds: the kernel grants one only while nobody has the file open for
// writing, and breaks it -- a signal carrying the descriptor -- before any later open for
// writing or truncate(2) proceeds. So a file whose lease holds cannot have been changed, and
// only one whose lease broke (or was never granted) needs the fstat.
//
// Granted only on local file systems (ext4, xfs, btrfs, tmpfs): a lease on a network file
// system does not see other machines' writers. Needs the file's owner or CAP_LEASE (a root
// daemon has it); without it the fstat stays. The signal handler releases the lease at once,
// so a writer waits a signal's delivery, not the kernel's lease-break-time (45 s).
#pragma once

namespace gpufeed {

// Takes a read lease on `fd` (opened read-only) and returns whether it holds now. `fd` must be
// an open file description of this process alone: the lease's signal and owner (F_SETSIG,
// F_SETOWN) belong to the description, so a client that shares it could make the kernel
// send any signal to the daemon, or one it ignores, leaving writers waiting out the kernel's
// lease-break-time. A client's descriptor is reopened first (file.cc). Installs
// the process-wide handler of the lease signal (SIGRTMIN + 7) on first use.
bool WatchByLease(int fd);

// Whether the lease WatchByLease took on `fd` still holds: false once a writer's open or a
// truncate broke it. Lock-free, async-signal-safe to race with the break.
bool LeaseHolds(int fd);

// Releases the lease on `fd` (before the descriptor is closed).
void EndLease(int fd);

// Whether `fd` is on a file system WatchByLease trusts (ext4, xfs, btrfs, tmpfs): a local one,
// where reopening a descriptor cannot wait on another process (a FUSE server) either.
bool OnLeasableFileSystem(int fd);

}  // namespace gpufeed
