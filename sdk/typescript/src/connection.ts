/**
 * Where the daemon is and how to talk to it, over Node's own http/https modules (they
 * speak HTTP over a unix socket, which the daemon serves by default, and stream both
 * ways). `FORKD_URL` is `unix:/path/to/forkd.sock`, `http://host:port` or
 * `https://host:port`; `FORKD_TOKEN` is the bearer token and `FORKD_CA` a CA bundle.
 */

import { readFileSync } from "node:fs";
import * as http from "node:http";
import * as https from "node:https";
import { homedir } from "node:os";
import { isAbsolute, join } from "node:path";
import { Readable } from "node:stream";

import WebSocket from "ws";

import { errorFor, ForkdError, UnreachableError } from "./errors.js";

export interface ConnectionOptions {
  /** Overrides `FORKD_URL`. */
  url?: string;
  /** Overrides `FORKD_TOKEN`. */
  token?: string;
  /** Overrides `FORKD_CA`: a PEM file. */
  ca?: string;
}

export type Query = Record<string, string | number | boolean | undefined> | [string, string][];

export interface RequestOptions {
  json?: unknown;
  query?: Query;
  /** A raw body: bytes, or a stream sent as it is read. */
  body?: Uint8Array | Readable | AsyncIterable<Uint8Array>;
}

/** The socket of the daemon on this host's default data directory. */
export function defaultSocket(): string {
  let home = process.env.FORKD_HOME;
  if (!home) {
    const xdg = process.env.XDG_DATA_HOME ?? "";
    if (process.getuid?.() === 0) home = "/var/lib/forkd";
    else if (isAbsolute(xdg)) home = join(xdg, "forkd");
    else home = join(homedir(), ".local", "share", "forkd");
  }
  return join(home, "forkd.sock");
}

function queryString(q: Query | undefined): string {
  if (!q) return "";
  const pairs = Array.isArray(q)
    ? q
    : Object.entries(q)
        .filter(([, v]) => v !== undefined)
        .map(([k, v]) => [k, String(v)] as [string, string]);
  return pairs.length ? "?" + new URLSearchParams(pairs).toString() : "";
}

/** What listens to a WebSocket from its first byte on ({@link Connection.websocket}). */
export interface WebSocketListeners {
  message: (data: Buffer, isBinary: boolean) => void;
  close: () => void;
}

/** A connection to one daemon. */
export class Connection {
  readonly url: string;
  private readonly socketPath: string | undefined;
  private readonly base: URL | undefined;
  private readonly headers: Record<string, string>;
  private readonly ca: Buffer | undefined;

  constructor(options: ConnectionOptions = {}) {
    this.url = options.url ?? process.env.FORKD_URL ?? "unix:" + defaultSocket();
    const token = options.token ?? process.env.FORKD_TOKEN;
    const ca = options.ca ?? process.env.FORKD_CA;
    this.headers = token ? { authorization: `Bearer ${token}` } : {};
    this.ca = ca ? readFileSync(ca) : undefined;
    if (this.url.startsWith("unix:")) {
      this.socketPath = this.url.slice("unix:".length);
    } else if (this.url.startsWith("http://") || this.url.startsWith("https://")) {
      this.base = new URL(this.url);
    } else {
      throw new Error(`FORKD_URL must be unix:/path, http://HOST:PORT or https://HOST:PORT: ${this.url}`);
    }
  }

  /** Sends one request and resolves with the response, its body not read yet. */
  private send(method: string, path: string, opts: RequestOptions): Promise<http.IncomingMessage> {
    const headers: Record<string, string> = { ...this.headers };
    let payload: Uint8Array | Readable | AsyncIterable<Uint8Array> | undefined = opts.body;
    if (opts.json !== undefined) {
      payload = Buffer.from(JSON.stringify(opts.json));
      headers["content-type"] = "application/json";
    }
    if (payload instanceof Uint8Array) headers["content-length"] = String(payload.length);
    const target = path + queryString(opts.query);
    const secure = this.base?.protocol === "https:";
    const requestOptions: https.RequestOptions = this.socketPath
      ? { socketPath: this.socketPath, path: target, method, headers }
      : {
          host: this.base!.hostname,
          port: this.base!.port,
          path: target,
          method,
          headers,
          ...(this.ca ? { ca: this.ca } : {}),
        };
    return new Promise((resolve, reject) => {
      const req = (secure ? https : http).request(requestOptions, resolve);
      req.on("error", (e: NodeJS.ErrnoException) => {
        // Nothing listening (or no socket file): say where we looked.
        const refused = ["ECONNREFUSED", "ENOENT", "EHOSTUNREACH", "ECONNRESET"];
        reject(
          e.code && refused.includes(e.code)
            ? new UnreachableError(`no forkd daemon answers at ${this.url}: ${e.message}`)
            : e,
        );
      });
      if (payload === undefined) req.end();
      else if (payload instanceof Uint8Array) req.end(payload);
      else Readable.from(payload).on("error", reject).pipe(req);
    });
  }

  private static async readAll(res: http.IncomingMessage): Promise<Buffer> {
    const chunks: Buffer[] = [];
    for await (const c of res) chunks.push(c as Buffer);
    return Buffer.concat(chunks);
  }

  private static async fail(res: http.IncomingMessage): Promise<never> {
    const text = (await Connection.readAll(res)).toString("utf8");
    let body: unknown = undefined;
    try {
      body = JSON.parse(text);
    } catch {
      // Not JSON: the status says enough.
    }
    throw errorFor(res.statusCode ?? 0, body);
  }

  /** One request; resolves with its decoded JSON answer (undefined when empty). */
  async request<T = unknown>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const res = await this.send(method, path, opts);
    if ((res.statusCode ?? 0) >= 400) return Connection.fail(res);
    const data = await Connection.readAll(res);
    return (data.length ? JSON.parse(data.toString("utf8")) : undefined) as T;
  }

  /**
   * One request whose answer is NDJSON, opened: resolves once its head has come, with the
   * response (destroying it ends the stream) and its lines, decoded, as they come.
   */
  async openLines(
    method: string,
    path: string,
    query: Query,
  ): Promise<{ res: http.IncomingMessage; lines: AsyncGenerator<Record<string, unknown>> }> {
    const res = await this.send(method, path, { query });
    if ((res.statusCode ?? 0) >= 400) await Connection.fail(res);
    return { res, lines: Connection.lines(res) };
  }

  /** One request whose answer is NDJSON: its lines, decoded, as they come. */
  async *streamLines(method: string, path: string, json: unknown): AsyncGenerator<Record<string, unknown>> {
    const res = await this.send(method, path, { json });
    if ((res.statusCode ?? 0) >= 400) await Connection.fail(res);
    yield* Connection.lines(res);
  }

  private static async *lines(res: http.IncomingMessage): AsyncGenerator<Record<string, unknown>> {
    let pending = Buffer.alloc(0);
    for await (const chunk of res) {
      pending = Buffer.concat([pending, chunk as Buffer]);
      let nl: number;
      while ((nl = pending.indexOf(10)) >= 0) {
        const line = pending.subarray(0, nl).toString("utf8").trim();
        pending = pending.subarray(nl + 1);
        if (line) yield JSON.parse(line) as Record<string, unknown>;
      }
    }
    const rest = pending.toString("utf8").trim();
    if (rest) yield JSON.parse(rest) as Record<string, unknown>;
  }

  /**
   * Opens the daemon's WebSocket at `path` (a terminal); rejects with the daemon's error
   * if it answers otherwise.
   */
  websocket(path: string, query: Query, listeners: WebSocketListeners): Promise<WebSocket> {
    const target = path + queryString(query);
    const url = this.socketPath
      ? `ws+unix://${this.socketPath}:${target}`
      : `${this.base!.protocol === "https:" ? "wss" : "ws"}://${this.base!.host}${target}`;
    const ws = new WebSocket(url, {
      headers: this.headers,
      ...(this.ca ? { ca: this.ca } : {}),
      maxPayload: 4 << 20,
    });
    // Listening from the start: the first messages may come with the handshake's
    // answer, in the same read, before whoever awaits the socket could listen.
    ws.on("message", listeners.message);
    ws.once("close", listeners.close);
    return new Promise((resolve, reject) => {
      ws.once("open", () => resolve(ws));
      ws.once("unexpected-response", (req, res) => {
        // Once this is listened for, ending the request is the listener's to do: an
        // open one would keep the process alive.
        Connection.fail(res).catch((e: unknown) => {
          req.destroy();
          reject(e);
        });
      });
      ws.once("error", (e: NodeJS.ErrnoException) => {
        const refused = ["ECONNREFUSED", "ENOENT", "EHOSTUNREACH", "ECONNRESET"];
        reject(
          e.code && refused.includes(e.code)
            ? new UnreachableError(`no forkd daemon answers at ${this.url}: ${e.message}`)
            : e,
        );
      });
    });
  }

  /** One request; its body in chunks as they arrive. */
  async *streamBytes(method: string, path: string, query: Query): AsyncGenerator<Uint8Array> {
    const res = await this.send(method, path, { query });
    if ((res.statusCode ?? 0) >= 400) await Connection.fail(res);
    for await (const chunk of res) yield chunk as Uint8Array;
  }
}

export { ForkdError };
