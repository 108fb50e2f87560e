/**
 * Terminals in a sandbox: `sandbox.pty`. Each is a command (by default the user's login
 * shell) on a pseudo-terminal of the guest, carried by the daemon's WebSocket
 * `/v1/sandboxes/{id}/pty`: bytes typed in, the screen's bytes out, resizes, and the
 * command's exit code at the end.
 */

import type WebSocket from "ws";

import type { Connection } from "./connection.js";
import { ForkdError } from "./errors.js";

/** The terminal ended without its command's exit. */
export class TerminalClosedError extends ForkdError {
  /** `paused` (its sandbox was paused), `removed`, `failed`, or `killed` (by `kill()`). */
  readonly reason: string;

  constructor(reason: string, message: string) {
    super(message ? `the terminal ended: ${reason}: ${message}` : `the terminal ended: ${reason}`, 0, reason);
    this.reason = reason;
  }
}

export interface PtyCreateOptions {
  /** Columns (80 by default). */
  cols?: number;
  /** Rows (24 by default). */
  rows?: number;
  /** What the terminal prints, as it comes. */
  onData?: (data: Uint8Array) => void;
  /** The program and its arguments; the user's login shell if none. */
  cmd?: string[];
  /** Variables for the command (`TERM` is `xterm-256color` unless given). */
  envs?: Record<string, string>;
  /** Working directory in the guest. */
  cwd?: string;
  /** The guest user to run as. */
  user?: string;
}

/** A terminal ({@link Pty.create}). */
export class PtyHandle {
  /** Its command's pid in the guest (set once {@link Pty.create} resolves). */
  pid = 0;
  private ws: WebSocket | undefined;
  private killed = false;
  private exitCode: number | undefined;
  private closed: TerminalClosedError | undefined;
  private readonly onData: ((data: Uint8Array) => void) | undefined;
  private onStarted: (pid: number) => void = () => {};
  private onNotStarted: (e: Error) => void = () => {};
  private onEnded: (code: number) => void = () => {};
  private onFailed: (e: Error) => void = () => {};
  private readonly ended: Promise<number>;
  /** @internal Resolves with the pid once the daemon says the command runs. */
  readonly started: Promise<number>;

  /** @internal */
  constructor(onData: ((data: Uint8Array) => void) | undefined) {
    this.onData = onData;
    this.started = new Promise((resolve, reject) => {
      this.onStarted = resolve;
      this.onNotStarted = reject;
    });
    this.ended = new Promise((resolve, reject) => {
      this.onEnded = resolve;
      this.onFailed = reject;
    });
    // A rejection nobody awaits yet is not an unhandled one: wait() hands it out.
    this.ended.catch(() => {});
    this.started.catch(() => {});
  }

  /** @internal Each message of the socket, from its first on. */
  receive(data: Buffer, isBinary: boolean): void {
    if (isBinary) {
      this.onData?.(new Uint8Array(data));
      return;
    }
    const msg = JSON.parse(data.toString("utf8")) as Record<string, unknown>;
    if (msg.type === "started") {
      this.pid = Number(msg.pid);
      this.onStarted(this.pid);
    } else if (msg.type === "exit") this.exitCode = Number(msg.exit_code);
    else if (msg.type === "closed") this.closed = new TerminalClosedError(String(msg.reason), String(msg.message ?? ""));
  }

  /** @internal The socket closed. */
  close(): void {
    this.onNotStarted(new TerminalClosedError("failed", "the terminal closed before it started"));
    if (this.exitCode !== undefined) this.onEnded(this.exitCode);
    else if (this.closed) this.onFailed(this.closed);
    else if (this.killed) this.onFailed(new TerminalClosedError("killed", ""));
    else this.onFailed(new TerminalClosedError("failed", "the connection to the daemon closed before the command ended"));
  }

  /** @internal */
  attach(ws: WebSocket): void {
    this.ws = ws;
  }

  private send(data: string | Uint8Array): Promise<void> {
    const ws = this.ws!;
    return new Promise((resolve, reject) => ws.send(data, (e) => (e ? reject(e) : resolve())));
  }

  /** Types `data` into the terminal (`"\x03"` is ^C). */
  sendInput(data: string | Uint8Array): Promise<void> {
    return this.send(typeof data === "string" ? Buffer.from(data, "utf8") : data);
  }

  /** Changes the terminal's size; its foreground command gets SIGWINCH. */
  resize(size: { cols: number; rows: number }): Promise<void> {
    return this.send(JSON.stringify({ type: "resize", cols: size.cols, rows: size.rows }));
  }

  /** Ends the terminal: its command's process group is killed. */
  kill(): void {
    this.killed = true;
    this.ws?.close();
  }

  /**
   * Resolves with the command's exit code once it ended (128 + the signal when one
   * ended it); rejects with {@link TerminalClosedError} if the terminal ended otherwise.
   */
  wait(): Promise<number> {
    return this.ended;
  }
}

/** The sandbox's terminals: `sandbox.pty`. */
export class Pty {
  /** @internal */
  constructor(
    private readonly conn: Connection,
    private readonly sandboxId: string,
  ) {}

  /** Starts a command on a terminal; it runs when this resolves. */
  async create(opts: PtyCreateOptions = {}): Promise<PtyHandle> {
    const query: [string, string][] = [
      ["cols", String(opts.cols ?? 80)],
      ["rows", String(opts.rows ?? 24)],
    ];
    for (const w of opts.cmd ?? []) query.push(["cmd", w]);
    for (const [k, v] of Object.entries(opts.envs ?? {})) query.push(["env", `${k}=${v}`]);
    if (opts.cwd !== undefined) query.push(["cwd", opts.cwd]);
    if (opts.user !== undefined) query.push(["user", opts.user]);
    const handle = new PtyHandle(opts.onData);
    const ws = await this.conn.websocket(`/v1/sandboxes/${this.sandboxId}/pty`, query, {
      message: (data, isBinary) => handle.receive(data, isBinary),
      close: () => handle.close(),
    });
    handle.attach(ws);
    await handle.started;
    return handle;
  }
}
