/** Sandboxes and snapshots: the SDK's surface over forkd's REST API. */

import { StringDecoder } from "node:string_decoder";
import { Readable } from "node:stream";

import { Connection, ConnectionOptions } from "./connection.js";
import { ForkdError, NotFoundError, SandboxFailedError, TimeoutError } from "./errors.js";
import { Pty } from "./pty.js";

type Json = Record<string, unknown>;
export type OutputHandler = (text: string) => void;

const b64 = (s: unknown): Buffer => Buffer.from(typeof s === "string" ? s : "", "base64");

/** How a command ended and what it wrote (`stdout`: the bytes decoded as UTF-8). */
export interface CommandResult {
  exitCode: number;
  stdout: string;
  stderr: string;
  stdoutBytes: Buffer;
  stderrBytes: Buffer;
  signal: number | null;
  timedOut: boolean;
  durationMs: number;
  truncated: boolean;
}

function commandResult(out: Buffer, err: Buffer, v: Json): CommandResult {
  return {
    exitCode: Number(v.exit_code),
    stdout: out.toString("utf8"),
    stderr: err.toString("utf8"),
    stdoutBytes: out,
    stderrBytes: err,
    signal: (v.signal as number | null) ?? null,
    timedOut: Boolean(v.timed_out),
    durationMs: Number(v.duration_ms ?? 0),
    truncated: Boolean(v.truncated),
  };
}

/** A background process as the sandbox tracks it (the last 1 MiB of each stream). */
export interface ProcessInfo {
  id: number;
  pid: number;
  argv: string[];
  startedAtMs: number;
  running: boolean;
  exitCode: number | null;
  signal: number | null;
  timedOut: boolean;
  stdout: string;
  stderr: string;
  stdoutBytes: Buffer;
  stderrBytes: Buffer;
  /** Whether its stdin is open for `sendStdin` (started with `stdin: true`). */
  stdinOpen: boolean;
}

function processInfo(v: Json): ProcessInfo {
  const out = b64(v.stdout_b64);
  const err = b64(v.stderr_b64);
  return {
    id: Number(v.id),
    pid: Number(v.pid),
    argv: (v.argv as string[]) ?? [],
    startedAtMs: Number(v.started_at_ms ?? 0),
    running: Boolean(v.running),
    exitCode: (v.exit_code as number | null) ?? null,
    signal: (v.signal as number | null) ?? null,
    timedOut: Boolean(v.timed_out),
    stdinOpen: Boolean(v.stdin_open),
    stdout: out.toString("utf8"),
    stderr: err.toString("utf8"),
    stdoutBytes: out,
    stderrBytes: err,
  };
}

/** A file, directory or link in the guest. */
export interface EntryInfo {
  path: string;
  name: string;
  type: string;
  size: number;
  mode: number;
  mtimeMs: number;
}

const entryInfo = (v: Json): EntryInfo => ({
  path: String(v.path),
  name: String(v.name),
  type: String(v.kind),
  size: Number(v.size),
  mode: Number(v.mode),
  mtimeMs: Number(v.mtime_ms),
});

/** A value a code cell produced: text, and HTML or a PNG (base64) where it has one. */
export interface Result {
  text: string;
  html?: string;
  png?: string;
}

const result = (v: Json): Result => ({
  text: String(v.text ?? ""),
  ...(typeof v.html === "string" ? { html: v.html } : {}),
  ...(typeof v.png === "string" ? { png: v.png } : {}),
});

/** The exception a code cell raised. */
export interface ExecutionError {
  name: string;
  value: string;
  traceback: string;
}

/** Everything one code cell produced. */
export interface Execution {
  results: Result[];
  logs: { stdout: string[]; stderr: string[] };
  error: ExecutionError | null;
  executionCount: number;
  /** The text of the cell's value, if it had one. */
  text: string | null;
}

function execution(): Execution {
  return {
    results: [],
    logs: { stdout: [], stderr: [] },
    error: null,
    executionCount: 0,
    get text() {
      return this.results[0]?.text ?? null;
    },
  };
}

/** A Python interpreter in a sandbox whose state persists between cells. */
export interface CodeContext {
  id: string;
  language: string;
  pid: number;
  executionCount: number;
}

const codeContext = (v: Json): CodeContext => ({
  id: String(v.id),
  language: String(v.language ?? "python"),
  pid: Number(v.pid ?? 0),
  executionCount: Number(v.execution_count ?? 0),
});

/**
 * What a sandbox's QEMU may use, chosen at fork; what is left unset takes the daemon's
 * default (memory: the guest's RAM plus 512 MiB; one core per vCPU; weight 100; 256
 * processes).
 */
export interface Limits {
  /** Memory in MiB, guest RAM included (less than the RAM is allowed). */
  memoryMib?: number;
  /** CPU quota in cores; 0 for none. */
  cpuCores?: number;
  /** Share of CPU under contention, 1 to 10000. */
  cpuWeight?: number;
  /** Processes and threads. */
  pids?: number;
}

/** A sandbox's limits as the daemon reports them, with what its cgroup counts. */
export interface SandboxLimits {
  memoryBytes: number;
  cpuCores: number | null;
  cpuWeight: number;
  pids: number;
  diskBytes: number | null;
  /** `cgroup v1` or `cgroup v2`; null when the host enforces no limits. */
  enforcedBy: string | null;
  memoryUsedBytes: number | null;
}

/**
 * A sandbox's egress policy: what its guest may reach. Chosen at fork (a fork that
 * gives none takes its snapshot's default), changed while it runs with
 * {@link Sandbox.setNetwork}, and read back in `info.network`.
 *
 * Destinations are `ADDRESS[/PREFIX][:PORT]` (IPv4; a port means TCP and UDP) or
 * `NAME[:PORT]` (a DNS name: `pypi.org`, or `*.pythonhosted.org` for the names under
 * it). Private ranges, the host and other sandboxes stay shut in every mode unless a
 * network inside them is in `allow`.
 */
export interface Network {
  /** `deny` (the default): only what `allow` lists gets out; `allow`: every public
   * destination but what `deny` lists; `off`: the NIC's link is down (no lists). */
  egress?: "deny" | "allow" | "off";
  /** Destinations let out. */
  allow?: string[];
  /** Destinations refused, in `allow` mode only (`allow` entries win over them). */
  deny?: string[];
}

/** A sandbox's egress policy as the daemon reports it, every field present. */
export interface SandboxNetwork {
  egress: "deny" | "allow" | "off";
  allow: string[];
  deny: string[];
}

const networkBody = (n: Network): Json => ({
  egress: n.egress ?? "deny",
  allow: n.allow ?? [],
  deny: n.deny ?? [],
});

const sandboxNetwork = (v: Json): SandboxNetwork => ({
  egress: (v.egress as SandboxNetwork["egress"] | undefined) ?? "deny",
  allow: ((v.allow as unknown[] | undefined) ?? []).map(String),
  deny: ((v.deny as unknown[] | undefined) ?? []).map(String),
});

/** A sandbox as the daemon lists it. */
export interface SandboxInfo {
  id: string;
  snapshot: string;
  status: string;
  labels: Record<string, string>;
  vcpus: number;
  memoryMib: number;
  createdAt: string;
  timeoutAt: number | null;
  error: string | null;
  limits: SandboxLimits | null;
  /** Its egress policy; null for a sandbox without NIC. */
  network: SandboxNetwork | null;
}

const sandboxLimits = (v: Json): SandboxLimits => ({
  memoryBytes: Number(v.memory_bytes ?? 0),
  cpuCores: (v.cpu_cores as number | null) ?? null,
  cpuWeight: Number(v.cpu_weight ?? 0),
  pids: Number(v.pids ?? 0),
  diskBytes: (v.disk_bytes as number | null) ?? null,
  enforcedBy: (v.enforced_by as string | null) ?? null,
  memoryUsedBytes: (v.memory_used_bytes as number | null) ?? null,
});

const sandboxInfo = (v: Json): SandboxInfo => ({
  id: String(v.id),
  snapshot: String(v.snapshot),
  status: String(v.status),
  labels: (v.labels as Record<string, string>) ?? {},
  vcpus: Number(v.vcpus ?? 0),
  memoryMib: Number(v.memory_mib ?? 0),
  createdAt: String(v.created_at ?? ""),
  timeoutAt: (v.timeout_at as number | null) ?? null,
  error: (v.error as string | null) ?? null,
  limits: v.limits ? sandboxLimits(v.limits as Json) : null,
  network: v.network ? sandboxNetwork(v.network as Json) : null,
});

export interface RunOptions {
  envs?: Record<string, string>;
  cwd?: string;
  /** Seconds. */
  timeout?: number;
  /** Given to the command on stdin. */
  stdin?: string | Uint8Array;
  onStdout?: OutputHandler;
  onStderr?: OutputHandler;
}

/** A background command's options: `stdin: true` keeps its stdin open for
 * `CommandHandle.sendStdin`; data is written to it, then it is closed. */
export type BackgroundOptions = Omit<RunOptions, "stdin" | "onStdout" | "onStderr"> & {
  background: true;
  stdin?: string | Uint8Array | boolean;
};

function commandBody(cmd: string | string[], o: Pick<RunOptions, "envs" | "cwd" | "timeout">): Json {
  const body: Json = typeof cmd === "string" ? { shell: cmd } : { cmd };
  if (o.envs) body.env = o.envs;
  if (o.cwd) body.cwd = o.cwd;
  if (o.timeout) body.timeout_s = o.timeout;
  return body;
}

/** A command running in the background. */
export class CommandHandle {
  constructor(
    private readonly sandbox: Sandbox,
    readonly id: number,
    readonly pid: number,
  ) {}

  private path(tail = ""): string {
    return `/v1/sandboxes/${this.sandbox.id}/processes/${this.id}${tail}`;
  }

  async info(): Promise<ProcessInfo> {
    return processInfo(await this.sandbox.conn.request<Json>("GET", this.path()));
  }

  /** Waits until it ends; rejects with TimeoutError if it still runs after `timeout` s. */
  async wait(timeout?: number): Promise<ProcessInfo> {
    const deadline = timeout === undefined ? undefined : Date.now() + timeout * 1000;
    for (;;) {
      const left = deadline === undefined ? 3600 : Math.max(0, (deadline - Date.now()) / 1000);
      const v = await this.sandbox.conn.request<Json>("POST", this.path("/wait"), {
        query: { timeout_s: Math.min(left, 3600) },
      });
      const info = processInfo(v);
      if (!info.running) return info;
      if (deadline !== undefined && Date.now() >= deadline) {
        throw new TimeoutError(`process ${this.id} still runs after ${timeout} s`);
      }
    }
  }

  /**
   * Sends `signal` (a number, 15, or a name, `"SIGTERM"`) to its process group, or with
   * `{ group: false }` to the process alone.
   */
  async sendSignal(signal: number | string, options: { group?: boolean } = {}): Promise<ProcessInfo> {
    const json = { signal, group: options.group ?? true };
    return processInfo(await this.sandbox.conn.request<Json>("POST", this.path("/signal"), { json }));
  }

  /** Kills its group and forgets it; resolves with how it ended. */
  async kill(): Promise<ProcessInfo> {
    return processInfo(await this.sandbox.conn.request<Json>("DELETE", this.path()));
  }

  /** Writes `data` to its stdin (it was started with `stdin: true`). */
  async sendStdin(data: string | Uint8Array): Promise<ProcessInfo> {
    return this.writeStdin(data, false);
  }

  /** Closes its stdin: its reads see end of file. */
  async closeStdin(): Promise<ProcessInfo> {
    return this.writeStdin(new Uint8Array(0), true);
  }

  /** @internal */
  async writeStdin(data: string | Uint8Array, close: boolean): Promise<ProcessInfo> {
    const raw = typeof data === "string" ? Buffer.from(data) : Buffer.from(data);
    // A JSON body is at most 1 MiB and base64 takes 4 bytes for 3: pieces of 512 KiB.
    const piece = 512 * 1024;
    let v: Json = {};
    let offset = 0;
    do {
      const part = raw.subarray(offset, offset + piece);
      offset += piece;
      const last = offset >= raw.length;
      v = await this.sandbox.conn.request<Json>("POST", this.path("/stdin"), {
        json: { data_b64: part.toString("base64"), close: close && last },
      });
    } while (offset < raw.length);
    return processInfo(v);
  }
}

/** Running commands in a sandbox: `sandbox.commands`. */
export class Commands {
  constructor(private readonly sandbox: Sandbox) {}

  /** Runs `cmd` (a shell command line, or an argv) and resolves with its result once
   * it ends; a non-zero exit is a result, not an error. With `onStdout`/`onStderr` the
   * output is handed over as it comes. */
  run(cmd: string | string[], options?: RunOptions & { background?: false }): Promise<CommandResult>;
  /** Starts `cmd` in the background and resolves with its handle at once. */
  run(cmd: string | string[], options: BackgroundOptions): Promise<CommandHandle>;
  async run(
    cmd: string | string[],
    options: (RunOptions & { background?: false }) | BackgroundOptions = {},
  ): Promise<CommandResult | CommandHandle> {
    const body = commandBody(cmd, options);
    const path = `/v1/sandboxes/${this.sandbox.id}`;
    if (options.background) {
      const stdin = options.stdin;
      if (stdin) body.stdin = true;
      const v = await this.sandbox.conn.request<Json>("POST", path + "/processes", { json: body });
      const handle = new CommandHandle(this.sandbox, Number(v.id), Number(v.pid));
      if (stdin !== undefined && typeof stdin !== "boolean") await handle.writeStdin(stdin, true);
      return handle;
    }
    if (options.stdin !== undefined) {
      const data = typeof options.stdin === "string" ? Buffer.from(options.stdin) : Buffer.from(options.stdin);
      body.stdin_b64 = data.toString("base64");
    }
    if (!options.onStdout && !options.onStderr) {
      const v = await this.sandbox.conn.request<Json>("POST", path + "/exec", { json: body });
      return commandResult(b64(v.stdout_b64), b64(v.stderr_b64), v);
    }
    body.stream = true;
    const streams = {
      stdout: { dec: new StringDecoder("utf8"), on: options.onStdout, bufs: [] as Buffer[] },
      stderr: { dec: new StringDecoder("utf8"), on: options.onStderr, bufs: [] as Buffer[] },
    };
    for await (const line of this.sandbox.conn.streamLines("POST", path + "/exec", body)) {
      const kind = line.type;
      if (kind === "stdout" || kind === "stderr") {
        const s = streams[kind];
        const data = b64(line.data_b64);
        s.bufs.push(data);
        const text = s.dec.write(data);
        if (s.on && text) s.on(text);
      } else if (kind === "exit") {
        for (const s of Object.values(streams)) {
          const rest = s.dec.end();
          if (s.on && rest) s.on(rest);
        }
        return commandResult(Buffer.concat(streams.stdout.bufs), Buffer.concat(streams.stderr.bufs), line);
      } else if (kind === "error") {
        throw new SandboxFailedError(String(line.message ?? "the command failed"));
      }
    }
    throw new ForkdError("the daemon ended the command's stream without its exit");
  }

  /** The sandbox's background processes, running and ended. */
  async list(): Promise<ProcessInfo[]> {
    const v = await this.sandbox.conn.request<Json[]>("GET", `/v1/sandboxes/${this.sandbox.id}/processes`);
    return v.map(processInfo);
  }
}

/** The sandbox's filesystem: `sandbox.files`. Paths are absolute guest paths. */
/** A change in a watched directory (see {@link Files.watchDir}). */
export interface FilesystemEvent {
  /** `create`, `write`, `remove`, `rename` (moved away), `chmod`, or `overflow` (events were dropped). */
  type: string;
  path: string;
  dir: boolean;
  /** For an overflow: how many events were dropped at least. */
  dropped?: number;
}

/** A directory watch: events go to its callback until {@link WatchHandle.stop}. */
export class WatchHandle {
  /** Why the watch ended by itself (the sandbox paused or removed), if it did. */
  error?: ForkdError;
  /** Settles once no more events will come. */
  readonly done: Promise<void>;
  private stopped = false;

  constructor(
    private readonly res: { destroy(): void },
    lines: AsyncGenerator<Record<string, unknown>>,
    onEvent: (e: FilesystemEvent) => void | Promise<void>,
  ) {
    this.done = (async () => {
      try {
        for await (const v of lines) {
          if (this.stopped) return;
          if (v.type === "error") {
            this.error = new SandboxFailedError(String(v.message), 0, "watch_ended");
            return;
          }
          await onEvent({
            type: String(v.type),
            path: String(v.path ?? ""),
            dir: Boolean(v.dir),
            dropped: v.dropped === undefined ? undefined : Number(v.dropped),
          });
        }
      } catch (e) {
        if (!this.stopped) this.error = new SandboxFailedError(`the watch ended: ${String(e)}`, 0, "watch_ended");
      }
    })();
  }

  /** Ends the watch; no event is delivered after it resolves. */
  async stop(): Promise<void> {
    this.stopped = true;
    this.res.destroy();
    await this.done;
  }
}

export class Files {
  private readonly base: string;

  constructor(private readonly sandbox: Sandbox) {
    this.base = `/v1/sandboxes/${sandbox.id}/files`;
  }

  /**
   * Watches the directory `path` (and, with `recursive`, those under it): each change
   * goes to `onEvent` until `stop()`. Watching has begun when the promise resolves.
   */
  async watchDir(
    path: string,
    onEvent: (e: FilesystemEvent) => void | Promise<void>,
    options: { recursive?: boolean } = {},
  ): Promise<WatchHandle> {
    const query = { path, recursive: options.recursive ? "true" : "false" };
    const { res, lines } = await this.sandbox.conn.openLines("GET", `${this.base}/watch`, query);
    return new WatchHandle(res, lines, onEvent);
  }

  /** The file as text (UTF-8). */
  read(path: string, options?: { format?: "text" }): Promise<string>;
  /** The file as bytes. */
  read(path: string, options: { format: "bytes" }): Promise<Buffer>;
  /** The file as a stream of chunks, as they arrive. */
  read(path: string, options: { format: "stream" }): Promise<AsyncIterable<Uint8Array>>;
  async read(
    path: string,
    options: { format?: "text" | "bytes" | "stream" } = {},
  ): Promise<string | Buffer | AsyncIterable<Uint8Array>> {
    const chunks = this.sandbox.conn.streamBytes("GET", this.base, { path });
    if (options.format === "stream") return chunks;
    const parts: Uint8Array[] = [];
    for await (const c of chunks) parts.push(c);
    const data = Buffer.concat(parts);
    return options.format === "bytes" ? data : data.toString("utf8");
  }

  /** Writes text, bytes or a stream (sent as it is read) to `path`, replacing it once
   * complete. */
  async write(
    path: string,
    data: string | Uint8Array | Readable | AsyncIterable<Uint8Array>,
    options: { mode?: number } = {},
  ): Promise<EntryInfo> {
    const body = typeof data === "string" ? Buffer.from(data) : data;
    const query: Record<string, string> = { path };
    if (options.mode !== undefined) query.mode = options.mode.toString(8);
    await this.sandbox.conn.request("PUT", this.base, { body, query });
    return this.stat(path);
  }

  async list(path: string): Promise<EntryInfo[]> {
    const v = await this.sandbox.conn.request<{ entries: Json[] }>("GET", this.base + "/list", { query: { path } });
    return v.entries.map(entryInfo);
  }

  async stat(path: string): Promise<EntryInfo> {
    return entryInfo(await this.sandbox.conn.request<Json>("GET", this.base + "/stat", { query: { path } }));
  }

  async exists(path: string): Promise<boolean> {
    try {
      await this.stat(path);
      return true;
    } catch (e) {
      if (e instanceof NotFoundError) return false;
      throw e;
    }
  }

  /** Makes a directory and its missing parents. */
  async makeDir(path: string): Promise<EntryInfo> {
    return entryInfo(await this.sandbox.conn.request<Json>("POST", this.base + "/mkdir", { json: { path } }));
  }

  async remove(path: string, options: { recursive?: boolean } = {}): Promise<void> {
    await this.sandbox.conn.request("DELETE", this.base, {
      query: { path, recursive: Boolean(options.recursive) },
    });
  }

  async rename(oldPath: string, newPath: string): Promise<EntryInfo> {
    return entryInfo(
      await this.sandbox.conn.request<Json>("POST", this.base + "/rename", { json: { from: oldPath, to: newPath } }),
    );
  }
}

export interface CreateOptions extends ConnectionOptions {
  /** Fork from this snapshot (default: the template's, named like the template). */
  snapshot?: string;
  /** Lifetime in seconds. */
  timeout?: number;
  labels?: Record<string, string>;
  /** Environment variables its commands and code contexts get. */
  envs?: Record<string, string>;
  vcpus?: number;
  memoryMib?: number;
  /** Limits of its QEMU beyond the daemon's defaults. */
  limits?: Limits;
  /** Its egress policy (default: the snapshot's). */
  network?: Network;
  /** What `timeout` does when it passes: `kill` (the default) or `pause`. */
  onTimeout?: "kill" | "pause";
  /** Pause it after this many seconds without a request; its next call resumes it. */
  autoPauseAfter?: number;
  /** Reuse a connection. */
  connection?: Connection;
}

function forkBody(snapshot: string, n: number, o: CreateOptions): Json {
  const body: Json = { snapshot, n };
  if (o.timeout !== undefined) body.timeout_s = o.timeout;
  if (o.labels) body.labels = o.labels;
  if (o.envs) body.env = o.envs;
  if (o.vcpus !== undefined) body.vcpus = o.vcpus;
  if (o.memoryMib !== undefined) body.memory_mib = o.memoryMib;
  if (o.limits) {
    const l = o.limits;
    const limits: Json = {};
    if (l.memoryMib !== undefined) limits.memory_mib = l.memoryMib;
    if (l.cpuCores !== undefined) limits.cpu_cores = l.cpuCores;
    if (l.cpuWeight !== undefined) limits.cpu_weight = l.cpuWeight;
    if (l.pids !== undefined) limits.pids = l.pids;
    body.limits = limits;
  }
  if (o.network) body.network = networkBody(o.network);
  if (o.onTimeout !== undefined) body.on_timeout = o.onTimeout;
  if (o.autoPauseAfter !== undefined) body.auto_pause_after_s = o.autoPauseAfter;
  return body;
}

const connectionOf = (o: CreateOptions & ConnectionOptions): Connection => o.connection ?? new Connection(o);

/** A snapshot: a template's frozen parent or a branch of a running sandbox. */
export class Snapshot {
  readonly tag: string;

  constructor(
    readonly info: Json,
    readonly conn: Connection,
  ) {
    this.tag = String(info.tag);
  }

  static async list(options: ConnectionOptions & { connection?: Connection } = {}): Promise<Snapshot[]> {
    const conn = connectionOf(options);
    const v = await conn.request<{ snapshots: Json[] }>("GET", "/v1/snapshots");
    return v.snapshots.map((s) => new Snapshot(s, conn));
  }

  static async get(tag: string, options: ConnectionOptions & { connection?: Connection } = {}): Promise<Snapshot> {
    const conn = connectionOf(options);
    return new Snapshot(await conn.request<Json>("GET", `/v1/snapshots/${tag}`), conn);
  }

  /** `n` children of this snapshot. */
  fork(n = 1, options: CreateOptions = {}): Promise<Sandbox[]> {
    return Sandbox.fork(this.tag, n, { ...options, connection: this.conn });
  }

  /** Removes it (`cascade`: with the snapshots built on it; `force`: stopping its
   * children first). */
  async delete(options: { cascade?: boolean; force?: boolean } = {}): Promise<void> {
    await this.conn.request("DELETE", `/v1/snapshots/${this.tag}`, {
      query: { cascade: Boolean(options.cascade), force: Boolean(options.force) },
    });
  }
}

export interface RunCodeOptions {
  context?: string | CodeContext;
  /** Seconds. */
  timeout?: number;
  onStdout?: OutputHandler;
  onStderr?: OutputHandler;
  onResult?: (r: Result) => void;
  onError?: (e: ExecutionError) => void;
  /** Variables set in `os.environ` for this run only. */
  envs?: Record<string, string>;
}

/** One running sandbox. */
export class Sandbox {
  readonly id: string;
  info: SandboxInfo;
  readonly commands: Commands;
  readonly files: Files;
  readonly pty: Pty;

  constructor(
    info: Json,
    readonly conn: Connection,
  ) {
    this.id = String(info.id);
    this.info = sandboxInfo(info);
    this.commands = new Commands(this);
    this.files = new Files(this);
    this.pty = new Pty(conn, this.id);
  }

  /** A new sandbox forked from `options.snapshot`, or from the template's snapshot. */
  static async create(template = "python", options: CreateOptions = {}): Promise<Sandbox> {
    const [s] = await Sandbox.fork(options.snapshot ?? template, 1, options);
    return s!;
  }

  /** `n` new sandboxes forked from `snapshot`, all or none. */
  static async fork(snapshot: string, n = 1, options: CreateOptions = {}): Promise<Sandbox[]> {
    const conn = connectionOf(options);
    const v = await conn.request<{ sandboxes: Json[] }>("POST", "/v1/sandboxes", {
      json: forkBody(snapshot, n, options),
    });
    return v.sandboxes.map((s) => new Sandbox(s, conn));
  }

  /** The sandbox `id`, resumed first if it is paused. */
  static async connect(id: string, options: ConnectionOptions & { connection?: Connection } = {}): Promise<Sandbox> {
    const conn = connectionOf(options);
    await conn.request("POST", `/v1/sandboxes/${id}/resume`);
    return new Sandbox(await conn.request<Json>("GET", `/v1/sandboxes/${id}`), conn);
  }

  /** The sandboxes, those carrying every label in `labels` if given. */
  static async list(
    options: ConnectionOptions & { connection?: Connection; labels?: Record<string, string> } = {},
  ): Promise<SandboxInfo[]> {
    const conn = connectionOf(options);
    const query = Object.entries(options.labels ?? {}).map(([k, v]) => ["label", `${k}=${v}`] as [string, string]);
    const v = await conn.request<{ sandboxes: Json[] }>("GET", "/v1/sandboxes", { query });
    return v.sandboxes.map(sandboxInfo);
  }

  async refresh(): Promise<SandboxInfo> {
    this.info = sandboxInfo(await this.conn.request<Json>("GET", `/v1/sandboxes/${this.id}`));
    return this.info;
  }

  async isRunning(): Promise<boolean> {
    try {
      return (await this.refresh()).status === "running";
    } catch (e) {
      if (e instanceof NotFoundError) return false;
      throw e;
    }
  }

  /** Stops the sandbox and removes its files. */
  async kill(): Promise<void> {
    await this.conn.request("DELETE", `/v1/sandboxes/${this.id}`);
  }

  /** Writes the sandbox to disk and ends its VM: it keeps its files, processes and
   * memory and costs no memory until resumed (by `resume`, `Sandbox.connect` or any
   * call that needs it). Pausing a paused sandbox rejects with ConflictError. */
  async pause(): Promise<void> {
    await this.conn.request("POST", `/v1/sandboxes/${this.id}/pause`);
    await this.refresh();
  }

  /** Runs the paused sandbox again, as it was (a running one is left as it is). */
  async resume(): Promise<void> {
    await this.conn.request("POST", `/v1/sandboxes/${this.id}/resume`);
    await this.refresh();
  }

  /** Ends the sandbox `timeout` seconds from now (null: never). */
  async setTimeout(timeout: number | null): Promise<void> {
    await this.conn.request("PUT", `/v1/sandboxes/${this.id}/timeout`, { json: { timeout_s: timeout } });
  }

  /** Replaces the sandbox's egress policy while it runs; it takes effect at once (what
   * the old policy's names had opened is shut again). Resolves to the sandbox's info
   * with the new policy; rejects with ConflictError for a sandbox without NIC. */
  async setNetwork(network: Network): Promise<SandboxInfo> {
    const v = await this.conn.request<Json>("PUT", `/v1/sandboxes/${this.id}/network`, {
      json: networkBody(network),
    });
    this.info = sandboxInfo(v);
    return this.info;
  }

  /** Snapshots this running sandbox, which runs on; the snapshot forks like a template. */
  async branch(options: { tag?: string; mode?: "live" | "pause" } = {}): Promise<Snapshot> {
    const body: Json = {};
    if (options.tag) body.tag = options.tag;
    if (options.mode) body.mode = options.mode;
    const v = await this.conn.request<Json>("POST", `/v1/sandboxes/${this.id}/branch`, { json: body });
    return Snapshot.get(String(v.snapshot), { connection: this.conn });
  }

  /** Runs a cell in a code context (the sandbox's first by default). The cell's
   * exception, if any, is in `execution.error`: it is not thrown. */
  async runCode(code: string, options: RunCodeOptions = {}): Promise<Execution> {
    const body: Json = { code };
    if (options.context !== undefined) {
      body.context = typeof options.context === "string" ? options.context : options.context.id;
    }
    if (options.timeout) body.timeout_s = options.timeout;
    if (options.envs && Object.keys(options.envs).length > 0) body.env = options.envs;
    const path = `/v1/sandboxes/${this.id}/code`;
    const x = execution();
    if (!options.onStdout && !options.onStderr && !options.onResult && !options.onError) {
      const v = await this.conn.request<Json>("POST", path, { json: body });
      x.results = ((v.results as Json[]) ?? []).map(result);
      if (v.stdout) x.logs.stdout.push(String(v.stdout));
      if (v.stderr) x.logs.stderr.push(String(v.stderr));
      if (v.error) x.error = v.error as ExecutionError;
      x.executionCount = Number(v.execution_count ?? 0);
      return x;
    }
    body.stream = true;
    for await (const line of this.conn.streamLines("POST", path, body)) {
      switch (line.type) {
        case "stdout":
          x.logs.stdout.push(String(line.text));
          options.onStdout?.(String(line.text));
          break;
        case "stderr":
          x.logs.stderr.push(String(line.text));
          options.onStderr?.(String(line.text));
          break;
        case "result": {
          const r = result(line);
          x.results.push(r);
          options.onResult?.(r);
          break;
        }
        case "error":
          // The daemon's own line when the sandbox failed mid-cell (no traceback).
          if (line.name === "SandboxError" && !line.traceback) {
            throw new SandboxFailedError(String(line.value ?? "the sandbox failed"));
          }
          x.error = { name: String(line.name), value: String(line.value), traceback: String(line.traceback) };
          options.onError?.(x.error);
          break;
        case "done":
          x.executionCount = Number(line.execution_count ?? 0);
          return x;
      }
    }
    throw new ForkdError("the daemon ended the cell's stream before its end");
  }

  async createCodeContext(options: { cwd?: string; envs?: Record<string, string> } = {}): Promise<CodeContext> {
    const body: Json = {};
    if (options.cwd) body.cwd = options.cwd;
    if (options.envs) body.env = options.envs;
    return codeContext(await this.conn.request<Json>("POST", `/v1/sandboxes/${this.id}/contexts`, { json: body }));
  }

  async listCodeContexts(): Promise<CodeContext[]> {
    return (await this.conn.request<Json[]>("GET", `/v1/sandboxes/${this.id}/contexts`)).map(codeContext);
  }

  async resetCodeContext(context: string | CodeContext): Promise<CodeContext> {
    const id = typeof context === "string" ? context : context.id;
    return codeContext(await this.conn.request<Json>("POST", `/v1/sandboxes/${this.id}/contexts/${id}/reset`));
  }

  async removeCodeContext(context: string | CodeContext): Promise<void> {
    const id = typeof context === "string" ? context : context.id;
    await this.conn.request("DELETE", `/v1/sandboxes/${this.id}/contexts/${id}`);
  }
}
